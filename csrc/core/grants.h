// Grants: what a route that reaches a peer's memory without the NICs (the cma route, for one)
// asks the owner before its first transfer to a region, and checks every call against.
//
// The owner decides what a peer may reach, as the NICs do on the fabric. Before the first
// transfer to a region, the initiator asks the owner for it with the region's key from its
// handle; the owner answers from its own registration (the region's address in its process,
// size, access and a digest of its rails' bases and keys: a handle that lies gets nothing more
// than the truth), or refuses. The initiator checks each call against the answers before any
// byte moves: the handle against the digest, the call against the access, every run and page
// against the owner's size. Answers are kept per (peer, region, key) until the owner closes the
// region, whose deregistration waits for the initiator's release (must_release), as on the
// fabric.
//
// The messages travel as the route's own (RouteHost::send with its id): an ask (1, region,
// key) and an answer (2, region, key, address, size, access, digest, the route's own fields
// (Granting's, length-prefixed), status kind, status message). The route keeps the rest:
// which peers and memory it reaches, who the owner answers at all, what it does with a call
// once its regions are answered, and how it moves the bytes.
//
// Owned by its route: every method runs on the worker thread.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <tuple>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "common/error.h"
#include "core/region.h"
#include "core/route.h"
#include "core/runs.h"

namespace p2p::core {

class Grants {
 public:
  // What the owner answered for one region: its address, size and access, or why not.
  struct Grant {
    bool answered = false;
    uint64_t region = 0;  // its id
    uint64_t ptr = 0;  // the region's address in the owner's process
    uint64_t nbytes = 0;
    uint8_t access = 0;
    uint32_t digest = 0;  // of the owner's registration
    std::string extra;    // the owner's route's own fields (Granting)
    Status refused;
    // The owner's region mapped into this process by the route, where it maps it (the cma
    // route, from the owner's file), at the region's first byte; copies in flight keep it.
    std::shared_ptr<uint8_t> mapped;
    uint64_t key = 0;  // the region's key the ask named (key())
  };
  // Where a call's remote region was answered (null: it was not, or released since).
  using Find = std::function<const Grant*(const RemoteRegion& r)>;
  // Owner side: why peer p gets no answer at all (the route is off, the peer out of its
  // reach), or ok to answer from the region's registration.
  using Refusal = std::function<Status(const Peer& p)>;
  // Owner side: called before an answer that grants `region` to p is sent, so that what p
  // needs beside the answer (a descriptor, the OS's consent) is there when the answer comes;
  // returns the route's own fields of the answer (Grant::extra), at most kExtraBytes.
  using Granting = std::function<std::string(Peer& p, const Region& region)>;
  static constexpr size_t kExtraBytes = 1024;

  // route: the route's id (its messages carry it); what: the messages' name in parse errors
  // (a literal, "cma message").
  Grants(RouteHost& host, uint8_t route, const char* what, Refusal refusal, Granting granting = nullptr)
      : host_(host), route_(route), what_(what), refusal_(std::move(refusal)), granting_(std::move(granting)) {}

  // Initiator side.
  // Takes t for the route (which checked that it may move it): counts it in t.pending until
  // the route ends it, and starts it with start(t) once every region it reaches is answered:
  // at once if start(t) takes it (true), else after asking the owner (resume()).
  template <class Start>
  void take(Transfer& t, Start&& start) {
    ++t.pending;
    host_.started(t, route_);
    if (!start(t)) wait(t);
  }
  // Whether the owner answered for every region t reaches.
  bool answered(const Transfer& t) const;
  // Asks the owner for each region of t not asked yet, and keeps t until resume() takes it.
  void wait(Transfer& t);
  // Offers each transfer waiting for p, in order, to start(Transfer&); those it takes (true)
  // wait no more.
  template <class Start>
  void resume(const Peer& p, Start&& start) {
    auto w = waiting_.find(p.incarnation);
    if (w == waiting_.end()) return;
    std::vector<Transfer*>& waiting = w->second;
    waiting.erase(std::remove_if(waiting.begin(), waiting.end(), [&](Transfer* t) { return start(*t); }),
                  waiting.end());
    if (waiting.empty()) waiting_.erase(w);
  }
  // Checks t against the answers for its regions (refused, released, a handle that differs,
  // an access the owner denies, a run or page outside its region) and only if all pass calls
  // each(local address, remote address, length) for every run and page: a refused call
  // changes nothing.
  template <class Each>
  Status resolve(const Transfer& t, Each&& each) {
    if (Status s = check(t); !s.ok()) return s;
    runs(t, [&](uint8_t* local, uint32_t rreg, uint64_t remote, uint64_t len) {
      each(local, call_[rreg]->ptr + remote, len);
      return true;
    });
    return Status{};
  }

  // Checks call t with peer `peer` against the answers find() gives: refused, released, a
  // handle that differs, an access the owner denies, a run or page outside its region. Fills
  // `call` with the answers by the call's remote region index.
  static Status check(const TransferCall& t, uint64_t peer, const Find& find, std::vector<const Grant*>& call);
  // Every run and page of t as (local address, remote region index, remote offset, length);
  // false if fn was false for any (each is visited anyway).
  template <class Fn>
  static bool runs(const TransferCall& t, Fn&& fn) {
    bool ok = true;
    for (const Run& run : t.runs) ok &= fn(reinterpret_cast<uint8_t*>(run.local), run.rreg, run.remote, run.len);
    for (const PageRuns& pr : t.pages)
      for_each_page(pr, t.page_ids.data(), [&](uint64_t local, uint64_t remote) {
        ok &= fn(reinterpret_cast<uint8_t*>(local), pr.rreg, remote, pr.bytes);
      });
    return ok;
  }
  // The key of a handle's region that its answers are kept under.
  static uint64_t key(const RemoteRegion& r) { return r.key.empty() ? 0 : r.key[0]; }

  // The answer for region r of peer `peer`, or null where none came.
  const Grant* find(uint64_t peer, const RemoteRegion& r) const {
    auto it = grants_.find(key_of(peer, r));
    return it != grants_.end() && it->second.answered ? &it->second : nullptr;
  }

  // The grants of the call that resolve() last passed, by its remote region index.
  const std::vector<const Grant*>& resolved() const { return call_; }

  // Whether `body`, a message of the route, is one of these (its first byte 1 or 2): a route
  // with messages of its own starts them with another byte.
  static bool carries(std::string_view body) { return !body.empty() && (body[0] == 1 || body[0] == 2); }
  // One of the route's messages: an ask is answered at once; an answer for a region asked is
  // kept and returned (the route resumes the peer's transfers), null for anything else.
  Grant* on_message(Peer& p, std::string_view body);

  // p failed: its waiting transfers end with its failure; its answers and grants are forgotten.
  void peer_failed(Peer& p);
  // Initiator side: the owner closes `region` of `peer`; its answers are forgotten.
  void release(uint64_t peer, uint64_t region);
  // Owner side: whether p was answered for `region` (and must release it); forgets it.
  bool must_release(const Region& region, const Peer& p);

 private:
  using Key = std::tuple<uint64_t, uint64_t, uint64_t>;  // peer, region, key
  static Key key_of(uint64_t peer, const RemoteRegion& r) { return {peer, r.id, key(r)}; }

  // resolve()'s checks; fills call_.
  Status check(const Transfer& t);
  // Owner side: the truth about `region`, if `key` is its key and p may be answered.
  void answer(Peer& p, uint64_t region, uint64_t key);

  RouteHost& host_;
  const uint8_t route_;
  const char* const what_;
  const Refusal refusal_;
  const Granting granting_;
  // Initiator side.
  std::map<Key, Grant> grants_;  // asked, answered or not
  std::unordered_map<uint64_t, std::vector<Transfer*>> waiting_;  // by peer
  std::vector<const Grant*> call_;  // check()'s, by the call's remote region index
  // Owner side: the peers that were answered for each region of ours.
  std::unordered_map<uint64_t, std::unordered_set<uint64_t>> granted_;
};

}  // namespace p2p::core
