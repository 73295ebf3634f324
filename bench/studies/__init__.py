"""One-off studies of the machines the benchmarks ran on, kept with their results: which BLAS
MLX's CPU backend should load (`blas`), what MKL's threads do on a busy 2-core machine
(`threads`), and how far a row's logits move with the row count of a forward
(`row_consistency`)."""
