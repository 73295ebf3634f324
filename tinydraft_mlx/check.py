"""`python -m tinydraft_mlx.check`: runs `tinydraft_mlx.programs.check`."""

if __name__ == "__main__":
    import sys

    from tinydraft_mlx.programs.check import main

    sys.exit(main())
