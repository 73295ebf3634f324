"""`python -m tinydraft_mlx.convert`: a conversion that keeps the MTP layer
(`tinydraft_mlx.programs.convert`)."""

if __name__ == "__main__":
    import sys

    from tinydraft_mlx.programs.convert import main

    sys.exit(main())
