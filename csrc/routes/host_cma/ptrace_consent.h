// Which processes may copy this process's private memory (process_vm_readv/writev: ptrace
// access) where Yama wants the owner's consent (kernel.yama.ptrace_scope 1, Ubuntu's default).
//
// PR_SET_PTRACER names one process (and its descendants) per process, so by default the cma
// route consents to the first same-host peer that needs it (a peer answered for a private
// region, or one that copies the staged route's slots) and to another only once that process
// is gone: a second peer's kernel copies are refused by the OS, and its probe sends its
// transfers to the fabric. TORCH_P2P_CMA_PTRACE=any consents instead to every process of the
// user (PR_SET_PTRACER_ANY), which opens the process as if Yama were off. With scope 0 no
// consent is needed; tensors in shared memory never need one (common/descriptors.h).
//
// Process-wide: the engines of one process share the one consent; any thread.
#pragma once

#include <sys/types.h>

#include <string>

namespace p2p::cma {

// Yama's ptrace_scope, or 0 where Yama is absent.
int ptrace_scope();

// Consents to every process of this user; false (errno) where the kernel refuses.
bool consent_to_any();

// Lets process `pid` copy this process's memory: true where it may (it, or any, has the
// consent), else gives it the consent unless another live process has it. False names in
// `holder` the process that has it (0: the kernel refused, errno).
bool consent_to(pid_t pid, pid_t& holder);

}  // namespace p2p::cma
