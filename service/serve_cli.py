"""`multihead serve` (owned by the service work)."""


def add_subcommands(sub) -> None:
    pass
