"""How a job comes in: the submit (validation, input files, admission), API keys, the Files and Batch APIs,
and the OpenAI-compatible requests and responses."""
