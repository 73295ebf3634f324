"""The generation API, a floor above the engine: `generate` and `stream_generate` (`api`),
`batch_generate` (`batching`), the options checked once (`options`), the text layer (`text`:
prompts, chat templates, streaming detokenization, stop strings), prompt caches
(`prompt_cache`) and checkpoint loading (`loading`).

Imports the engine below it; nothing here imports the serving floor or the programs. The public
names are importable from `tinydraft_mlx` itself.
"""
