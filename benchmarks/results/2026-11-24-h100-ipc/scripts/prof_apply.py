"""Applies the temporary profiling counters (git checkout the files to undo)."""
import shutil
import os, sys
if len(sys.argv) > 1 and sys.argv[1] == "undo":
    os.remove("csrc/common/prof.h")
else:
    shutil.copy(".device/prof.h", "csrc/common/prof.h")
import sys
UNDO = len(sys.argv) > 1 and sys.argv[1] == "undo"
def sub(path, old, new, count=1):
    if UNDO:
        old, new = new, old
    s = open(path).read()
    assert s.count(old) >= 1, (path, old)
    s = s.replace(old, new, count)
    open(path, "w").write(s)
sub("csrc/engine/transfer.h", "  double timeout_s = 0;\n};", "  double timeout_s = 0;\n  uint64_t st[4] = {0, 0, 0, 0};  // PROF submit, worker, launched, seen\n};")
sub("csrc/engine/completions.h", "  std::string address;  // recv: the sender's engine address\n};",
    "  std::string address;  // recv: the sender's engine address\n  uint64_t st[5] = {0, 0, 0, 0, 0};  // PROF\n};")
sub("csrc/engine/completions.h", '#include "common/error.h"', '#include "common/error.h"\n#include "common/prof.h"')
sub("csrc/engine/engine.cpp", '#include "common/log.h"', '#include "common/log.h"\n#include "common/prof.h"')
sub("csrc/engine/engine.cpp", """  auto t = transfers_.take();
  const bool cuda = build(*t, write, local, remote, local_pages, remote_pages, mirror, notify, timeout_s);
  start(id, std::move(t), cuda);""", """  prof::Scope whole{prof::Submit};
  const uint64_t b0 = prof::now();
  auto t = transfers_.take();
  const bool cuda = build(*t, write, local, remote, local_pages, remote_pages, mirror, notify, timeout_s);
  prof::add(prof::Build, b0);
  start(id, std::move(t), cuda);""")
sub("csrc/engine/engine.cpp", """  t->id = id;
#ifdef WITH_CUDA
  if (cuda) {""", """  t->id = id;
  t->st[0] = prof::now();
#ifdef WITH_CUDA
  if (cuda) {
    prof::Scope ev{prof::Event};""")
sub("csrc/engine/engine.cpp", "void Engine::enqueue(std::unique_ptr<Transfer> t) { post(StartTransfer{std::move(t)}); }",
    "void Engine::enqueue(std::unique_ptr<Transfer> t) {\n  prof::Scope s{prof::Post};\n  post(StartTransfer{std::move(t)});\n}")
sub("csrc/engine/engine.cpp", """    for (Completion& c : batch) {
      if (futures_.complete(c))""", """    for (Completion& c : batch) {
      const uint64_t c0 = prof::now();
      const bool ok = futures_.complete(c);
      prof::add(prof::DComplete, c0);
      if (ok && c.st[0]) {
        const uint64_t e = prof::now();
        prof::span(prof::LQueue, c.st[0], c.st[1]);
        prof::span(prof::LLaunch, c.st[1], c.st[2]);
        prof::span(prof::LCopy, c.st[2], c.st[3]);
        prof::span(prof::LReport, c.st[3], c.st[4]);
        prof::span(prof::LDone, c.st[4], e);
      }
      if (ok)""")
sub("csrc/engine/transfers.cpp", """void Worker::start(Transfer* raw) {
  assert_on_worker();
  Transfer& t = *raw;""", """void Worker::start(Transfer* raw) {
  assert_on_worker();
  prof::Scope s{prof::WStart};
  Transfer& t = *raw;
  t.st[1] = prof::now();""")
sub("csrc/engine/transfers.cpp", '#include "common/log.h"', '#include "common/log.h"\n#include "common/prof.h"')
sub("csrc/engine/transfers.cpp", """  t.enter(TransferState::Reported);
  report(t.id, t.status);""", """  t.enter(TransferState::Reported);
  report(t.id, t.status);
  for (int k = 0; k < 4; ++k) reports_.back().st[k] = t.st[k];""")
sub("csrc/engine/worker.cpp", '#include "common/log.h"', '#include "common/log.h"\n#include "common/prof.h"')
sub("csrc/engine/worker.cpp", """void Worker::hand_over_reports() { completions_->push_all(reports_); }""",
    """void Worker::hand_over_reports() {
  if (reports_.empty()) return;
  prof::Scope s{prof::WReport};
  const uint64_t n = prof::now();
  for (auto& c : reports_) c.st[4] = n;
  completions_->push_all(reports_);
}""")
sub("csrc/engine/worker.cpp", """  while (!stopping_.load(std::memory_order_relaxed)) {
    bool busy = drain_commands();""", """  while (!stopping_.load(std::memory_order_relaxed)) {
    prof::Scope it{prof::LoopIter};
    const uint64_t b0 = prof::now();
    bool busy = drain_commands();""")
sub("csrc/engine/worker.cpp", """    if (ipc_) ipc_->flush();  // the copies this turn queued, in one launch""",
    """    if (ipc_) {
      const uint64_t f0 = prof::now();
      if (ipc_->flush()) {
        prof::add(prof::WLaunch, f0);
        for (auto& [ticket, id] : ipc_copies_) if (auto it = transfers_.find(id); it != transfers_.end() && !it->second->st[2]) it->second->st[2] = prof::now();
      }
    }""")
sub("csrc/engine/worker.cpp", """    busy |= post_ops();
    const double t = now();""", """    busy |= post_ops();
    if (busy) prof::add(prof::Busy, b0);
    const double t = now();""")
sub("csrc/ipc/route.h", "  void flush() { memory_->flush(); }", "  bool flush() { return memory_->flush(); }")
sub("csrc/ipc/memory.h", "  virtual void flush() = 0;", "  virtual bool flush() = 0;")
sub("csrc/ipc/cuda_memory.cpp", """  void flush() override {
    if (!queued_) return;""", """  bool flush() override {
    if (!queued_) return false;""")
sub("csrc/ipc/cuda_memory.cpp", """    pending_ = {};
    queued_ = false;
  }""", """    pending_ = {};
    queued_ = false;
    return true;
  }""")
sub("csrc/ipc/worker_hooks.cpp", '#include "common/log.h"', '#include "common/log.h"\n#include "common/prof.h"')
sub("csrc/ipc/worker_hooks.cpp", """  const uint64_t ticket =
      ipc_->copy(""", """  const uint64_t c0 = prof::now();
  const uint64_t ticket =
      ipc_->copy(""")
sub("csrc/ipc/worker_hooks.cpp", """  t.route = TransferRoute::Ipc;""", """  prof::add(prof::WCopy, c0);
  t.route = TransferRoute::Ipc;""")
sub("csrc/ipc/worker_hooks.cpp", """    if (it != transfers_.end()) transfer_op_done(*it->second, status);""",
    """    if (it != transfers_.end()) {
      it->second->st[3] = prof::now();
      transfer_op_done(*it->second, status);
    }""")
sub("csrc/ipc/cuda_memory.cpp", '#include "common/log.h"', '#include "common/log.h"\n#include "common/prof.h"')
sub("csrc/ipc/cuda_memory.cpp", """    if (after) note(cudaStreamWaitEvent(stream_, static_cast<cudaEvent_t>(after), 0));""",
    """    if (after) {
      prof::Scope w{prof::WWaitEvent};
      note(cudaStreamWaitEvent(stream_, static_cast<cudaEvent_t>(after), 0));
    }""")
sub("csrc/bindings.cpp", '#include "common/error.h"', '#include "common/error.h"\n#include "common/prof.h"')
sub("csrc/bindings.cpp", """        const CallArgs a = call_args(local, remote, notify, timeout);
        start(e, id, future, [&] {""", """        const uint64_t p0 = prof::now();
        const CallArgs a = call_args(local, remote, notify, timeout);
        prof::add(prof::Parse, p0);
        start(e, id, future, [&] {""")
sub("csrc/bindings.cpp", "  bind_wire(m);\n}", """  m.def("_prof", [] {
    py::dict d;
    const char* names[] = {"Submit", "Build", "Event", "Post", "WStart", "WCopy", "WWaitEvent", "WLaunch", "WReport",
                           "DComplete", "LoopIter", "LQueue", "LLaunch", "LCopy", "LReport", "LDone", "Busy", "Parse"};
    for (int s = 0; s < prof::kSlots; ++s)
      d[names[s]] = py::make_tuple(prof::total[s].exchange(0), prof::calls[s].exchange(0));
    return d;
  });
  bind_wire(m);
}""")
