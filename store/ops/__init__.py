"""Operations on a whole store: copy it to another location (a directory or PostgreSQL, either
direction), back it up to one archive file and restore it, check its integrity.

    dump.py       the neutral form of a store's data (`Snapshot`: every row of every data table,
                  and each version's head), read by each backend from ONE consistent snapshot
                  (`store.directory.dump`, `store.pg.dump`), and the loading side (`Target`)
    copy.py       `copy_store`: a snapshot loaded into an empty store, bot by bot, resumable
    archive.py    `backup` (a snapshot written to a tar with a manifest) and `open_archive`
                  (an archive read back as a snapshot: `restore` is a copy from it)
    check.py      `check_store`: blobs present and matching, no dangling rows, orphans listed

Rows are copied as they are (ids, times, hashes, revocations, `last_used`, audit records): no
registration API runs, nothing is re-stamped or audited again. The serving processes' leases
are live state, not data: never copied.
"""
