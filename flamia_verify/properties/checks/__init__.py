"""The checks, one module per family; importing this package registers them all."""

from flamia_verify.properties.checks import causal, error, interface, isolation  # noqa: F401

__all__: list[str] = []
