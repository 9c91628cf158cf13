// Route: the staged route (staging.h says how it moves bytes). It takes every transfer with a
// staged end, local or remote, makes slot jobs of it as slots come free, and serves peers'
// requests for our staged regions from the serve half of the pool. Its RMA ops are the
// fabric's (RouteHost::make_ops); its copies are the copier's.
#pragma once

#include <cstdint>
#include <memory>
#include <unordered_map>
#include <vector>

#include "core/ops.h"
#include "core/route.h"
#include "routes/staged/staging.h"

namespace p2p::staged {

using engine::Peer;
using engine::SlotJob;
using engine::Transfer;

class Route final : public engine::Route {
 public:
  Route(engine::RouteHost& host, uint8_t id) : host_(host), id_(id) {}
  ~Route() override;

  const char* name() const override { return "staged"; }
  bool advertised() const override { return false; }  // the regions' handles say it
  bool reaches(const engine::EngineAddress& a, const engine::RemoteRegion* region) override;
  void describe(engine::Region& region, engine::RemoteRegion& handle) override;
  bool take(Transfer& t) override;
  bool poll() override;
  // The copier does not wake the worker: a copy in flight keeps it polling.
  bool idle() const override { return copying_.empty(); }
  void on_message(Peer&, std::string_view) override {}
  bool on_control(Peer& p, engine::Message& m) override;
  void tick() override;
  void peer_failed(Peer& p) override;
  void release(uint64_t, uint64_t) override {}
  bool must_release(const engine::Region&, const Peer&) override { return false; }
  void stop() override;

  void job_op_done(SlotJob& job, const Status& status);

 private:
  // slots.cpp: the pool.
  void ensure_slots();
  engine::Slot* take_slot(bool serve);
  void give_slot(engine::Slot* slot);
  void rekey(engine::Slot& slot);

  // staging.cpp: both sides.
  bool make_jobs(Transfer& t);  // false: no slot free (t waits at the queue's front)
  bool generate();
  void start_job(SlotJob& job);
  uint64_t start_copy(SlotJob& job, bool pack);
  void send_request(SlotJob& job);
  void send_ack(Peer& p, uint64_t request, const Status& status);
  size_t request_run_limit() const;
  void advance(SlotJob& job);
  bool generate_job_ops(SlotJob& job);
  bool run_step(SlotJob& job);
  bool run_copy(SlotJob& job);
  void finish_job(SlotJob& job);
  void on_stage_ack(const engine::StageAck& m);
  void poll_copies();

  // staging_serve.cpp: the owner's side.
  void on_stage_request(Peer& p, engine::StageRequest req);
  void serve(Peer& p, engine::StageRequest req, std::shared_ptr<engine::Region> region);

  engine::RouteHost& host_;
  const uint8_t id_;
  std::vector<std::unique_ptr<engine::Slot>> slots_;
  std::vector<engine::Slot*> free_slots_[2];  // [serve]
  void* slot_memory_ = nullptr;
  std::unordered_map<uint64_t, std::unique_ptr<SlotJob>> jobs_;
  engine::Ring<Transfer*> queue_;       // taken transfers whose jobs are not all made yet
  engine::Ring<uint64_t> serve_queue_;  // ids of requests waiting for a serve slot
  std::vector<SlotJob*> copying_;
  engine::Ring<SlotJob*> job_gen_queue_;
  uint64_t next_request_ = 1;
};

}  // namespace p2p::staged
