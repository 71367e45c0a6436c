"""The OpenAI APIs: chat and text completions, the Responses API, their schemas, prompt rendering,
logprobs and structured output."""
