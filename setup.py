"""megacp: context parallelism (ring prefill, all-gather decode) for long-context LLMs."""

from setuptools import find_packages, setup

setup(
    name="megacp",
    version="0.1.0",
    description="Context parallelism for long-context LLM inference and training: "
    "pass-KV / pass-Q ring prefill, all-gather decode, CP-sharded KV cache.",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["megacp", "megacp.*"]),
    install_requires=[
        "torch>=2.4",
        "pydantic>=2",
        "hjson",
        "safetensors",
        "tqdm",
    ],
    extras_require={
        "deepspeed": ["deepspeed>=0.14"],
        "serve": ["fastapi", "uvicorn"],
        "te": ["transformer-engine[pytorch]"],
        # cuDNN's own sliding-window attention (megacp.attention.kernels.cudnn_band; CUDA only)
        "cudnn": ["nvidia-cudnn-frontend>=1.32"],
        # transformers 5: the tokenizers megacp exports name its TokenizersBackend class (4.57 cannot load them);
        # peft: LoRA adapters (megacp.integrations.lora; its dependencies are transformers' and accelerate's)
        "hf": ["transformers>=5.0", "safetensors", "gguf>=0.10", "accelerate", "sentencepiece", "peft>=0.22"],
        # triton: the fused merges run in Triton's CPU interpreter in the tests (GPUs compile them)
        "dev": ["pytest", "pytest-timeout", "pytest-xdist", "hypothesis", "ruff", "mypy", "transformers>=5.0", "gguf>=0.10", "accelerate", "sentencepiece",
                "triton; platform_system == 'Linux'",
                "fastapi", "uvicorn", "httpx", "openai"],
    },
    entry_points={"console_scripts": ["megacp-generate=megacp.generate:main", "megacp-serve=megacp.serve.cli:entry"]},
)
