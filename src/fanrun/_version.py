__version__ = "0.1.0"  # as pyproject.toml says
