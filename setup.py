"""multihead: many image classifiers ("bots") sharing one Inception-V4 trunk."""
from setuptools import setup

# NOTE: tf-keras 2.21 declares `tensorflow>=2.21,<2.22`, so requiring `tensorflow-cpu` here as
# well would install two TensorFlow distributions over each other in one site-packages. The
# plain `tensorflow` wheel runs on the CPU; GPU users install the `gpu` extra, which adds
# TensorFlow's CUDA libraries (`tensorflow[and-cuda]`).
TF_VERSION = "2.21.0"

setup(
    name="multihead",
    version="0.1.0",
    description="Serve many image classifiers that share one Inception-V4 trunk",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.11",  # asyncio.timeout (the batcher)
    packages=["backbone", "heads", "service", "service.codecs", "service.cli", "bench"],
    package_data={"service": ["static/*"]},
    install_requires=[
        f"tensorflow=={TF_VERSION}",
        "tf-slim==1.1.0",
        # Same minor version as TensorFlow: tf-slim's layers need tf_keras' legacy layers.
        "tf-keras==2.21.0",
        # NOTE: service.app replaces aiohttp's RequestHandler.handle_error (JSON answers to
        # unparseable requests); re-check that hook when moving past 3.14.
        "aiohttp>=3.14,<3.15",
        "numpy>=1.26,<3",
        "pillow>=10.0",
        "prometheus_client>=0.20",
        "tqdm>=4.66",
        # multipart/form-data bodies parsed by the codecs, whatever the transport (strict,
        # sans-I/O, no dependencies).
        "multipart>=2.0.1,<3",
    ],
    extras_require={
        "gpu": [f"tensorflow[and-cuda]=={TF_VERSION}"],
        # The benchmark's latency/throughput plot (`multihead bench`; JSON and Markdown
        # reports need nothing more).
        "bench": ["matplotlib>=3.8"],
        "test": [
            "pytest>=8.0",
            "pytest-aiohttp>=1.0",
            "pytest-timeout>=2.3",
            # Drives Debian's chromium through Debian's chromedriver (`make browser-deps`);
            # 4.52.0 needs a newer certifi than the package index here has.
            "selenium==4.51.0",
            "ruff==0.17.5",
            # Property tests of the codecs (tests/fuzz).
            "hypothesis==6.170.15",
        ],
        # The trunk on OpenVINO (`--runtime openvino`), compiled in-process from the restored
        # tf-slim graph.
        "openvino": ["openvino==2026.4.1"],
        # `make mutation`: mutmut 3 (mutants in a `mutants/` copy, per-function test selection).
        "mutation": ["mutmut==3.8.1"],
    },
    entry_points={"console_scripts": ["multihead=service.cli.main:main"]},
)
