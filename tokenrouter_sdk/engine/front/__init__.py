"""The front room: what a user's requests meet. `engine.Engine` (submission, admission, outputs,
abort, the event trace), its calls and handles, KV admission, incremental detokenization and the
committed-token metrics of a call's events."""
