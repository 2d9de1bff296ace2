"""`multihead register|train|bots` (owned by the heads work)."""


def add_subcommands(sub) -> None:
    pass
