"""Hostile tenants: ONE definition of the attacks of issue 34 (`bench.hostile.attacks`) and of
the world they run in (`bench.hostile.world`: a `multihead serve --auth keys` process, tenant
`attacker` (A) and tenant `victim` (B) with their keys and bots, B's closed loop).

Two users: the hostile-tenant suite (tests/hostile, short attacks, asserting answers only) and
the bench section `isolation` (`bench.sections.isolation`, longer attacks, B's latency alone
and under each attack as `--check` targets). Nothing heavy is imported at module level.
"""
