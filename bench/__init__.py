"""The benchmarks a user runs, each a script run from the repository's root as a module
(`python -m bench.batch`), each writing results/<name>.json and .png; `common` is what they
share, `render_readme` renders results/README.md's tables from the JSON (its sections in
`render_*`). One-off studies of this machine live in `bench/studies/`."""
