"""Pure-Python package: Triton kernels + torch.library ops + the Qwen decoder. Nothing is compiled at install."""
from setuptools import find_packages, setup

setup(
    name="qwen-triton-ops",
    version="0.1.0",
    description="Qwen-family decoders from hand-written Triton kernels registered as torch.ops.qwen custom ops",
    packages=find_packages(include=["csrc_free_ops", "qwen_ops", "modeling"]),
    python_requires=">=3.10",
    install_requires=["torch>=2.6", "triton>=3.3", "safetensors>=0.4", "tokenizers>=0.19"],
    extras_require={"test": ["pytest>=8", "expecttest>=0.2", "transformers>=4.56"]},
)
