"""What the tests share, each piece defined once.

- `fakes`: stand-ins for unit tests of logic (`FakeService`, `FakeClock`, `FakeTrunk`,
  `GatedTrunk`).
- `builders`: test data (`random_head`).
- `servers`: real servers on loopback for end-to-end tests (the `store`, `jpegs`,
  `make_client` fixtures) and reading their /metrics.
- `polling`: waiting until a condition holds (`wait_until`, and `until` on the event loop).
"""
