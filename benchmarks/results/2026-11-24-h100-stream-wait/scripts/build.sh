#!/bin/bash
# Builds torch_p2p._C in place on the device against the system libfabric 1.17 runtime.
set -e
if [ ! -f /tmp/lf/usr/include/rdma/fabric.h ]; then
  dpkg -x .device/libfabric-dev_*.deb /tmp/lf
  mkdir -p /tmp/lf/usr/lib64
  ln -sf "$(ls /usr/lib/x86_64-linux-gnu/libfabric.so.1* | head -1)" /tmp/lf/usr/lib64/libfabric.so
fi
export LIBFABRIC_HOME=/tmp/lf/usr TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=${MAX_JOBS:-16}
python3 setup.py build_ext --inplace > ${BUILD_LOG:-/tmp/build.log} 2>&1 || { tail -40 ${BUILD_LOG:-/tmp/build.log}; exit 1; }
grep "torch_p2p build" ${BUILD_LOG:-/tmp/build.log}
