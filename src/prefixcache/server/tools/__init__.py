"""Tool use shared by the APIs: tool definitions rendered into the prompt, tool calls parsed from
the output."""
