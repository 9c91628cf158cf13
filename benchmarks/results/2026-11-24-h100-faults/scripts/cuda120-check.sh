#!/bin/bash
# Run on the CPU machine from the repository root: do the CUDA sources compile against the
# CUDA 12.0 headers (PyPI's nvidia-cuda-*-cu12 12.0 wheels; PyPI has no 12.0 nvcc binary)?
# The .cpp files with g++; the .cu with the local nvcc 13.0 front end reading the 12.0 headers,
# which gets through the device compile and fails only in nvcc 13's own generated launch stub
# (its __cudaLaunch takes two arguments, 12.0's one): a toolkit mix, not the sources.
set -e
W=/tmp/cu120; mkdir -p $W/x && cd $W
pip download --no-deps -d . "nvidia-cuda-nvcc-cu12==12.0.*" "nvidia-cuda-runtime-cu12==12.0.*" "nvidia-cuda-cccl-cu12==12.0.*"
for w in *.whl; do python -m zipfile -e $w x/; done
R=$W/x/nvidia; mkdir -p $W/include; cp -rn $R/cuda_runtime/include/* $R/cuda_nvcc/include/* $R/cuda_cccl/include/* $W/include/
cd - > /dev/null
mkdir -p /tmp/stub/c10/cuda/impl && echo '#define C10_CUDA_BUILD_SHARED_LIBS' > /tmp/stub/c10/cuda/impl/cuda_cmake_macros.h
TI=$(python -c "import torch,os;print(os.path.join(os.path.dirname(torch.__file__),'include'))")
PI=$(python -c "import sysconfig;print(sysconfig.get_paths()['include'])")
for f in csrc/cuda/*.cpp csrc/engine/*.cpp csrc/*.cpp csrc/ipc/*.cpp; do
  g++ -std=c++20 -fsyntax-only -w -DWITH_CUDA -Icsrc -I/tmp/stub -I$W/include -I$TI -I$TI/torch/csrc/api/include -I$PI $f || echo "FAILED: $f"
done
nvcc -std=c++17 -arch=sm_90 -Icsrc -I$W/include -c csrc/cuda/copy_kernels.cu -o /tmp/ck120.o 2>&1 | grep error | grep -v __cudaLaunch || echo "copy_kernels.cu: no error but the launch stub's"
