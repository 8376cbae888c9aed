"""What the model's text means: the chat template that renders a conversation into prompt ids
(`chat_template`), and one reply parser (`reply.ReplyParser`) that reads the model's reply back into reasoning,
text, tool calls and their arguments, and a finish reason. Every caller uses it: the server's chat, Responses
and Ollama APIs, and the in-process chat. Below the engine; imports nothing of the server, chat or engine."""
