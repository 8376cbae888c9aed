"""Tools and output constraints: `tool_choice` and `response_format` -> one grammar (output_spec.py), legacy
`functions`, and server-side MCP tools with the loop that runs their calls between model turns."""
