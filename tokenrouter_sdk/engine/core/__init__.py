"""The sub-server room: what serves one model. `subserver.SubServer` (messages in, a step out)
and its loop (`serve_loop`), its scheduler, KV block allocator, prefix cache and paged KV pool, the
forward that fails only the requests whose inputs fail (`forward`), the sampler, the rules that end a
request where tokens are committed (`commit_rules`), the byte view of models that do not share a
tokenizer (`text_mode`), and the policy host (`policy_host`), the one module that calls a policy's hooks."""
