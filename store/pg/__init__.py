"""The PostgreSQL backend: registry, head tensors and labels in one database (psycopg 3).

For replicas on many machines: `open_store("postgresql://user@host:5432/dbname")` needs no
shared filesystem. Everything lives in the schema `multihead` of that database, created by the
first registration (a reader of a database without it sees an empty store). Built like the
directory backend (`store.directory`, with `heads.files`):

    backend.py    PgBackend: the parts composed, the data version, closing
    database.py   reads, and the one shape of every write transaction (writer lock, NOTIFY)
    bots.py       the bots part: registry rows
    blobs.py      the blobs part: float32 tensors and labels, each with its sha256
    accounts.py   the accounts part: `accounts.rows` in the same transactions
    leases.py     the leases part: the serving processes' leases (no change_seq, no NOTIFY)
    pool.py       pooled connections, and what a lost connection means for a read or a write
    listener.py   the LISTEN/NOTIFY thread, and the change counter `data_version` is made of
    schema.py     the schema, its tables rendered from `store.schema`

psycopg is imported only by this package, and this package only for a PostgreSQL store.
"""
from store.pg.backend import PgBackend

__all__ = ["PgBackend"]
