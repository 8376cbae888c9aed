"""`tfserve chat`: a terminal chat client for any OpenAI-compatible server, or a model loaded in-process.

    conversation.py  messages + sampling settings, saved and loaded as JSON
    client.py        ChatBackend protocol, RemoteBackend (the `openai` SDK), the errors shown to the user
    local.py         LocalBackend: the engine in this process, no server
    session.py       one chat: send a turn, stream it, keep stats; errors become one red line; the tool loop
    agent.py         MCP tool calls: panels, approval, running them, the `tool` messages
    mcp_tools.py     McpToolbox: the MCP servers on a background event loop, their tools as OpenAI functions
    render.py        live markdown while a reply streams, the footer after it
    commands.py      slash commands
    repl.py          the prompt-toolkit loop, and piped mode
"""
