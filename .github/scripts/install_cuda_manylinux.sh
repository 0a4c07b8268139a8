#!/usr/bin/env bash
# cibuildwheel before-all (manylinux_2_28, AlmaLinux 8): the CUDA compiler, runtime headers, CCCL and cuBLAS
# headers + libraries from NVIDIA's repository. CUDA_MAJOR=13 (default) or 12 (the CUDA 12 wheels).
set -euo pipefail
major="${CUDA_MAJOR:-13}"
case "$major" in
  13) ver=13-0 ;;
  12) ver=12-8 ;;
  *) echo "CUDA_MAJOR must be 12 or 13" >&2; exit 2 ;;
esac
dnf install -y dnf-plugins-core
dnf config-manager --add-repo https://developer.download.nvidia.com/compute/cuda/repos/rhel8/x86_64/cuda-rhel8.repo
dnf install -y "cuda-nvcc-$ver" "cuda-cudart-devel-$ver" "cuda-cccl-$ver" "libcublas-devel-$ver"
ln -sfn "/usr/local/cuda-${ver/-/.}" /usr/local/cuda
/usr/local/cuda/bin/nvcc --version
