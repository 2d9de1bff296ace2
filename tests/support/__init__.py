"""What the tests share, each piece defined once.

- `fakes`: stand-ins for unit tests of logic (`FakeService`, `FakeClock`, `FakeTrunk`,
  `GatedTrunk`).
- `builders`: test data (`random_head`).
- `servers`: real servers on loopback for end-to-end tests (the `store`, `jpegs`,
  `make_client` fixtures).
- `prometheus`: reading their /metrics (`metric`), through `bench.prometheus`.
- `int8`: ONE real INT8 calibration of the session's trunk and the INT8 trunk loaded from it
  (`int8_calibrated`, `int8_trunk`).
- `polling`: waiting until a condition holds (`wait_until`, and `until` on the event loop).
- `limits`: what a tenant limit accepts, and the values hypothesis tries on it.
"""
