"""The engine: token ids in, token ids out. Sampling and logits processors (`sampling`), the
acceptance rule (`rejection`), KV caches that roll back (`cache`), the compiled forward and the
prefill (`forward`, `skinny` on the CPU), draft sources behind one protocol (`drafters`, with
`lookup` and `pruning`; their batched chains of draft steps in `chains`), heads that read the
target's hidden states (`hidden` captures them; the MTP layer in `mtp`, EAGLE-3 in `eagle`),
recurrent layers that roll back (`recurrent`), the choice of k and of tree or chain
(`policy`), candidate trees (`trees`: their shape and walk; `tree_verify`: their forward and
commit), statistics (`stats`), tensor-parallel ranks (`distributed`), the loop of rounds for
one sequence (`speculative`) and for a batch of them (`rounds`, its rows in `sequence`, on the
per-row caches of `batch_cache`).

Knows nothing about text, the generation API or serving, which live a floor up in the package
(`text`, `prompt_cache`, `api`, `loading`; then the server and the entry points). The public
names are importable from `tinydraft_mlx` itself.
"""
