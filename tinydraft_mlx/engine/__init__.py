"""The engine: token ids in, token ids out. Sampling and logits processors (`sampling`), the
acceptance rule (`rejection`), KV caches that roll back (`cache`), the compiled forward and the
prefill (`forward`, `skinny` on the CPU), draft sources behind one protocol (`drafters`, with
`lookup` and `pruning`), the choice of k (`policy`), statistics (`stats`), tensor-parallel ranks
(`distributed`), the loop of rounds for one sequence (`speculative`) and for a batch of them
(`batch`, on the per-row caches of `batch_cache`).

Knows nothing about text, the generation API or serving, which live a floor up in the package
(`text`, `prompt_cache`, `api`, `loading`; then the server and the entry points). The public
names are importable from `tinydraft_mlx` itself.
"""
