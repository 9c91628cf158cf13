// Route: the staged route (staging.h says how it moves bytes). It takes every transfer with a
// staged end, local or remote, makes slot jobs of it as slots come free, and serves peers'
// requests for our staged regions from the serve half of the pool. Its RMA ops are the
// fabric's (Rails::make_ops), or on one host the cma route's copies (PeerCopies); its
// packs and unpacks are the copier's.
#pragma once

#include <cstdint>
#include <memory>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "core/grants.h"
#include "core/ops.h"
#include "core/route.h"
#include "routes/staged/staging.h"

namespace p2p::staged {

class Route final : public core::Route {
 public:
  // same_host: the cma route's copies, for the host hop to peers it reaches (null: none).
  Route(core::RouteHost& host, uint8_t id, core::PeerCopies* same_host);
  ~Route() override;

  const char* name() const override { return "staged"; }
  bool advertised() const override { return false; }  // the regions' handles say it
  bool reaches(const core::EngineAddress& a, const core::RemoteRegion* region) override;
  bool keeps_off_nics(int cuda_device) const override;
  void describe(core::Region& region, core::RemoteRegion& handle) override;
  bool take(Transfer& t) override;
  bool poll() override;
  // The copier does not wake the worker: a copy in flight keeps it polling.
  bool idle() const override { return copying_.empty(); }
  void on_message(Peer& p, std::string_view body) override;
  void tick() override;
  void peer_failed(Peer& p) override;
  void release(uint64_t peer, uint64_t region) override { grants_.release(peer, region); }
  bool must_release(const core::Region& region, const Peer& p) override { return grants_.must_release(region, p); }
  void stop() override;

  void job_op_done(SlotJob& job, const Status& status);

 private:
  // slots.cpp: the pool.
  void ensure_slots();
  Slot* take_slot(bool serve);
  void give_slot(Slot* slot);
  void rekey(Slot& slot);
  void hold_slot(SlotJob& job);  // until the peer's process exits
  void release_held();

  // host_hop.cpp: the host hop by cma.
  bool runs_by_cma(const Transfer& t) const;
  bool queue_by_cma(Transfer& t);
  void copy_by_cma(SlotJob& job);
  void on_grant_message(Peer& p, std::string_view body);

  // A taken transfer whose jobs are not all made yet, and the first byte no job moves yet.
  struct Queued {
    Transfer* t = nullptr;
    RunCursor at;
  };

  // staging.cpp: both sides.
  bool make_jobs(Transfer& t, RunCursor& at);  // false: no slot free (t waits at the queue's front)
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
  void on_stage_ack(const StageAck& m);
  void poll_copies();

  // staging_serve.cpp: the owner's side.
  void on_stage_request(Peer& p, StageRequest req);
  void serve(Peer& p, StageRequest req, std::shared_ptr<Region> region);

  core::RouteHost& host_;
  const uint8_t id_;
  core::PeerCopies* const same_host_;
  core::Grants grants_;  // the owners' answers for the regions RmaRuns copies into by cma
  std::unordered_set<const Transfer*> by_cma_;  // queued, its runs' remote addresses the owner's
  std::vector<std::pair<Slot*, int>> held_;  // slots a failed peer may still copy with: its pidfd
  std::vector<std::unique_ptr<Slot>> slots_;
  std::vector<Slot*> free_slots_[2];  // [serve]
  void* slot_memory_ = nullptr;
  std::unordered_map<uint64_t, std::unique_ptr<SlotJob>> jobs_;
  core::Ring<Queued> queue_;
  core::Ring<uint64_t> serve_queue_;  // ids of requests waiting for a serve slot
  std::vector<SlotJob*> copying_;
  core::Ring<SlotJob*> job_gen_queue_;
  uint64_t next_request_ = 1;
};

}  // namespace p2p::staged
