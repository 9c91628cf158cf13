#include "routes/host_cma/ptrace_consent.h"

#include <signal.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <cerrno>
#include <fstream>
#include <mutex>

namespace p2p::cma {

namespace {

std::mutex mu;
bool any = false;
pid_t consented = 0;  // the process PR_SET_PTRACER named last

// A zombie counts as alive: Yama keeps its consent until the process is reaped.
bool alive(pid_t pid) { return kill(pid, 0) == 0 || errno == EPERM; }

}  // namespace

int ptrace_scope() {
  std::ifstream in("/proc/sys/kernel/yama/ptrace_scope");
  int scope = 0;
  return in >> scope ? scope : 0;
}

bool consent_to_any() {
  std::lock_guard<std::mutex> lock(mu);
  if (!any && prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0) != 0) return false;
  any = true;
  return true;
}

bool consent_to(pid_t pid, pid_t& holder) {
  std::lock_guard<std::mutex> lock(mu);
  if (any || consented == pid || pid == getpid()) return true;  // a process may always read itself
  if (consented != 0 && alive(consented)) {
    holder = consented;
    return false;
  }
  holder = 0;
  if (prctl(PR_SET_PTRACER, pid, 0, 0, 0) != 0) return false;
  consented = pid;
  return true;
}

}  // namespace p2p::cma
