"""A seeded generator of hostile requests over every route and protocol.

Each case is (method, path, headers, body). Most are malformed in one way that a parser can
trip on (broken multipart, JSON nested past any limit, NaN/Inf, wrong lengths and shapes,
invalid UTF-8, absurd numbers, traversal-looking ids, bad query values); a few are valid, so
the server also has real work mixed in.
"""
from __future__ import annotations

import base64
import json
import random
import struct
from dataclasses import dataclass, field

BOTS = ("alpha", "bravo", "nobody", "../etc/passwd", "a" * 65, "%00", "bad id", "ümlaut",
        "a:b", ".hidden", "x" * 64)
VERSIONS = ("1", "2", "0", "-1", "abc", "99999999999999999999", "1.5", "")
TOP_K = ("1", "3", "0", "-5", "abc", "", "1e9", "999999999999999999999", "NaN", "٣", " 2")
# X-Multihead-Deadline-Ms values (issue 32): malformed (400 invalid_deadline), tiny (504), fine.
DEADLINES = ("", "abc", "0", "-1", "NaN", "inf", "1e400", "3600001", "0x10", "٣", " ", "1" * 400,
             "60000", "0.001", "1e-300")
CONTENT_TYPES = ("image/png", "image/jpeg", "application/octet-stream", "text/plain",
                 "multipart/form-data", "multipart/form-data; boundary=", "application/json",
                 "multipart/form-data; boundary=XYZ", "", "image/", "*/*; q=0.1",
                 "multipart/form-data; boundary=\"unterminated")


@dataclass
class Case:
    method: str
    path: str
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    kind: str = ""


class Generator:
    """Cases from one seed; `image` is a small valid PNG the generator mutates and reuses.
    With `api_key`, about a third of the cases that carry no credential present that key
    (`Authorization: Bearer`, or `X-Api-Key`): the server's logs must never show it."""

    def __init__(self, seed: int, image: bytes, token: str, api_key: str | None = None) -> None:
        self.rng = random.Random(seed)
        self.image = image
        self.token = token
        self.api_key = api_key
        self.makers = [getattr(self, name) for name in sorted(dir(self))
                       if name.startswith("case_")]

    def __iter__(self):
        while True:
            case = self.rng.choice(self.makers)()
            if self.rng.random() < 0.15:
                case.headers["X-Multihead-Deadline-Ms"] = self.pick(DEADLINES)
            if self.api_key and "Authorization" not in case.headers and self.rng.random() < 0.3:
                name = self.pick(("Authorization", "X-Api-Key"))
                case.headers[name] = (f"Bearer {self.api_key}" if name == "Authorization"
                                      else self.api_key)
            yield case

    # -- building blocks ---------------------------------------------------------------------

    def pick(self, seq):
        return self.rng.choice(seq)

    def junk(self, low: int = 0, high: int = 300) -> bytes:
        return self.rng.randbytes(self.rng.randint(low, high))

    def mutated_image(self) -> bytes:
        data = bytearray(self.image)
        how = self.rng.randrange(5)
        if how == 0:
            return bytes(data[: self.rng.randrange(len(data))])  # truncated
        if how == 1:
            for _ in range(self.rng.randint(1, 8)):
                data[self.rng.randrange(len(data))] = self.rng.randrange(256)  # bit rot
            return bytes(data)
        if how == 2:
            return b"\x89PNG\r\n\x1a\n" + self.junk()  # a header and garbage
        if how == 3:
            return b"\xff\xd8\xff\xe0" + self.junk()  # a JPEG header and garbage
        return self.image  # valid (cache hits after the first)

    def multipart(self) -> tuple[str, bytes]:
        boundary = self.pick(("XyZ", "a" * 70, "-", "b b", ""))
        parts = []
        for _ in range(self.rng.randint(0, 4)):
            name = self.pick(("image", "image", "other", "", "im\"age", "labels", "index"))
            filename = self.pick(("", "; filename=\"a.png\"", "; filename=\"../../x.index\"",
                                  "; filename=\"x.data-00000-of-00001\""))
            payload = self.mutated_image() if name == "image" else self.junk(0, 50)
            parts.append(f"--{boundary}\r\nContent-Disposition: form-data; name=\"{name}\""
                         f"{filename}\r\n\r\n".encode() + payload + b"\r\n")
        body = b"".join(parts)
        damage = self.rng.randrange(7)
        if damage == 0:
            body += f"--{boundary}--\r\n".encode()  # well formed
        elif damage == 1:
            body = body[: self.rng.randrange(len(body) + 1)]  # truncated, no final boundary
        elif damage == 2:
            body += b"--WRONG--\r\n"
        elif damage == 3:
            body = body.replace(b"\r\n\r\n", b"\r\n", 1) + f"--{boundary}--".encode()
        elif damage == 4:
            body = f"--{boundary}\r\n".encode() + b"X-Long: " + b"h" * 9000 + b"\r\n\r\n"
        elif damage == 5:
            body = b"".join(f"--{boundary}\r\nContent-Disposition: form-data; name=\"p\"\r\n\r\n"
                            f"1\r\n".encode() for _ in range(400)) + f"--{boundary}--\r\n".encode()
        ctype = self.pick((f"multipart/form-data; boundary={boundary}",
                           "multipart/form-data", f"multipart/form-data; boundary=\"{boundary}\"",
                           "multipart/form-data; boundary=other"))
        return ctype, body

    def nested(self, depth: int) -> str:
        return "[" * depth + "1" + "]" * self.rng.choice((depth, depth - 1, 0))

    def number(self):
        return self.pick((1.0, -1.0, 0.5, 1e39, -1e39, "NaN", "Infinity", "-Infinity", True,
                          None, "x", 1e-45, 2.0, [], {}))

    # -- native ------------------------------------------------------------------------------

    def case_classify_raw(self) -> Case:
        bot = self.pick(BOTS[:3] + BOTS[3:] * (self.rng.random() < 0.3))
        query = self.pick(("", f"?top_k={self.pick(TOP_K)}", "?top_k=2&top_k=x", "?%zz=1",
                           "?top_k=" + "9" * 500))
        body = self.mutated_image() if self.rng.random() < 0.8 else self.junk()
        return Case("POST", f"/classify/{bot}{query}",
                    {"Content-Type": self.pick(CONTENT_TYPES)}, body, "classify-raw")

    def case_classify_multipart(self) -> Case:
        ctype, body = self.multipart()
        bot = self.pick(BOTS[:3])
        return Case("POST", f"/classify/{bot}?top_k={self.pick(TOP_K)}",
                    {"Content-Type": ctype}, body, "classify-multipart")

    def case_classify_many(self) -> Case:
        bots = self.pick(("alpha,bravo", "", ",,,", "alpha," * 70, "alpha,nobody",
                          "../x,alpha", "alpha,alpha", "%E2%82%AC", "a" * 3000))
        ctype, body = (("image/png", self.mutated_image()) if self.rng.random() < 0.5
                       else self.multipart())
        return Case("POST", f"/classify?bots={bots}&top_k={self.pick(TOP_K)}",
                    {"Content-Type": ctype}, body, "classify-many")

    def case_get(self) -> Case:
        path = self.pick(("/bots", f"/bots/{self.pick(BOTS)}", "/healthz", "/readyz",
                          "/metrics", "/v2", "/v2/health/live", "/v2/health/ready",
                          f"/v2/models/{self.pick(BOTS)}",
                          f"/v2/models/{self.pick(BOTS)}/versions/{self.pick(VERSIONS)}",
                          f"/v2/models/{self.pick(BOTS)}/ready",
                          f"/v1/models/{self.pick(BOTS)}",
                          f"/v1/models/{self.pick(BOTS)}/versions/{self.pick(VERSIONS)}",
                          f"/v1/models/{self.pick(BOTS)}/metadata", "/nope", "/classify",
                          "/static/../../etc/passwd", "/%2e%2e/%2e%2e/etc/passwd"))
        return Case(self.pick(("GET", "GET", "HEAD", "OPTIONS", "PATCH")), path, {}, b"", "get")

    def case_admin(self) -> Case:
        auth = self.pick((f"Bearer {self.token}", "Bearer wrong", "Basic abc", "", "Bearer",
                          f"bearer {self.token}", "Bearer " + "x" * 5000))
        headers = {"Authorization": auth} if auth else {}
        bot = self.pick(BOTS)
        what = self.rng.randrange(3)
        if what == 0:
            ctype, body = self.multipart()
            return Case("PUT", f"/bots/{bot}", {**headers, "Content-Type": ctype}, body,
                        "admin-put")
        if what == 1:
            return Case("POST", f"/bots/{bot}/rollback?to={self.pick(VERSIONS)}", headers,
                        b"", "admin-rollback")
        # Never delete the bots the other cases use.
        return Case("DELETE", f"/bots/{self.pick(('nobody', '../x', 'zz' * 40))}", headers,
                    b"", "admin-delete")

    # -- Open Inference Protocol v2 ------------------------------------------------------------

    def oip_input(self):
        kind = self.rng.randrange(9)
        b64 = base64.b64encode(self.mutated_image()).decode()
        if kind == 0:
            return {"name": "image_bytes", "datatype": "BYTES", "shape": [1], "data": [b64]}
        if kind == 1:
            return {"name": "image_bytes", "datatype": "BYTES",
                    "shape": self.pick(([2], [1, 2], [-1], [10**12], [], [1, 1, 1], "x")),
                    "data": self.pick(([b64], ["!!notb64"], [1, 2], b64, [[b64]], None))}
        if kind == 2:
            shape = self.pick(([1, 299, 299, 3], [1, 2, 2, 3], [0, 299, 299, 3],
                               [10**9, 299, 299, 3], [1, 299, 299], [-1, 299, 299, 3]))
            data = self.pick(([self.number()] * 12, [0.0] * 12, self.number(), [[1, [2]]], []))
            return {"name": "images", "datatype": "FP32", "shape": shape, "data": data}
        if kind == 3:
            return {"name": "x", "datatype": self.pick(("INT8", "FP64", "", None, 5, "BYTES")),
                    "shape": [1], "data": [1]}
        if kind == 4:
            return {"name": self.pick((None, 5, "", "x" * 1000)), "datatype": "BYTES",
                    "shape": [1], "data": ["AA=="]}
        if kind == 5:
            return {"name": "image_bytes", "datatype": "BYTES", "shape": [1],
                    "parameters": {"binary_data_size": self.pick((4, 10**9, -1, "x", 0))}}
        if kind == 6:
            return {"name": "images", "datatype": "FP32", "shape": [1, 299, 299, 3],
                    "parameters": {"binary_data_size": self.pick((16, 299 * 299 * 3 * 4 - 4))}}
        if kind == 7:
            return self.pick(([], "x", None, 5))
        return {"name": "image_bytes", "datatype": "BYTES", "shape": [1], "data": [b64],
                "parameters": self.pick(("x", [], {"binary_data_size": None}))}

    def case_oip_json(self) -> Case:
        what = self.rng.randrange(6)
        if what == 0:
            body = ('{"inputs": ' + self.nested(self.pick((10, 1000, 100_000))) + "}").encode()
        elif what == 1:
            request = {"inputs": [self.oip_input()]}
            if self.rng.random() < 0.5:
                request["parameters"] = {"deadline_ms": self.pick(
                    ("x", -1, None, True, [], {}, float("inf"), 1e9, 60000, 0.0001, "60000"))}
            body = json.dumps(request).encode()
        elif what == 2:
            body = json.dumps({"inputs": [self.oip_input() for _ in range(2)],
                               "outputs": self.pick(([{"name": "probabilities"}], [], "x",
                                                     [{"name": "nope"}],
                                                     [{"name": "probabilities",
                                                       "parameters": {"classification":
                                                                      self.number()}}]))}
                              ).encode()
        elif what == 3:
            body = b'{"inputs": [{"name": "images", "datatype": "FP32", "shape": [1, 2], ' \
                   b'"data": [NaN, Infinity]}]}'
        elif what == 4:
            body = b'{"id": "\xff\xfe", "inputs": []}'  # invalid UTF-8
        else:
            body = self.junk()
        bot = self.pick(BOTS[:3])
        version = self.pick(("", "/versions/1", f"/versions/{self.pick(VERSIONS)}"))
        return Case("POST", f"/v2/models/{bot}{version}/infer",
                    {"Content-Type": "application/json"}, body, "oip-json")

    def case_oip_binary(self) -> Case:
        element = self.mutated_image()
        lengths = self.pick((len(element), len(element) + 10, 0, 2**32 - 1))
        blob = struct.pack("<I", lengths) + element
        size = self.pick((len(blob), len(blob) - 1, len(blob) + 5, 0, 3))
        header = json.dumps({"inputs": [{"name": "image_bytes", "datatype": "BYTES",
                                         "shape": [1],
                                         "parameters": {"binary_data_size": size}}],
                             "outputs": [{"name": "probabilities",
                                          "parameters": {"binary_data": True}}]}).encode()
        length = self.pick((str(len(header)), str(len(header) + 3), "-1", "abc", "",
                            str(10**20), " 5"))
        return Case("POST", f"/v2/models/{self.pick(BOTS[:3])}/infer",
                    {"Content-Type": "application/octet-stream",
                     "Inference-Header-Content-Length": length}, header + blob, "oip-binary")

    # -- TF Serving ----------------------------------------------------------------------------

    def tf_instance(self):
        b64 = base64.b64encode(self.mutated_image()).decode()
        return self.pick(({"b64": b64}, {"b64": "!!"}, {"b64": 5}, b64, [[1.0]],
                          {"image_bytes": {"b64": b64}}, {"a": 1, "b": 2}, None, [],
                          [[[self.number()] * 3] * 2] * 2))

    def case_tfserving(self) -> Case:
        what = self.rng.randrange(6)
        if what == 0:
            body = json.dumps({"instances": [self.tf_instance()
                                             for _ in range(self.rng.randint(0, 3))]}).encode()
        elif what == 1:
            body = json.dumps({"inputs": self.pick((self.tf_instance(),
                                                    {"image_bytes": [self.tf_instance()]},
                                                    [self.tf_instance()], 5, None))}).encode()
        elif what == 2:
            body = json.dumps({"instances": [], "inputs": [],
                               "signature_name": self.pick(("", "nope", 5))}).encode()
        elif what == 3:
            body = ('{"instances": ' + self.nested(self.pick((50, 100_000))) + "}").encode()
        elif what == 4:
            body = b'{"instances": [[NaN, -Infinity]]}'
        else:
            body = self.junk()
        verb = self.pick((":predict", ":predict", ":classify", ":", ":" + "x" * 100))
        return Case("POST", f"/v1/models/{self.pick(BOTS[:3])}{verb}?top_k={self.pick(TOP_K)}",
                    {"Content-Type": "application/json"}, body, "tfserving")
