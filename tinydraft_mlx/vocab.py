"""`python -m tinydraft_mlx.vocab`: runs `tinydraft_mlx.programs.vocab`."""

if __name__ == "__main__":
    import sys

    from tinydraft_mlx.programs.vocab import main

    sys.exit(main())
