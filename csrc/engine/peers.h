// Peers: every engine this one knows, by incarnation. No world: a peer is whoever we were given
// an address of, or whoever introduced itself. Here: introduction (HELLO and its answer),
// leaving (BYE), liveness checks, process watching, and the decision that a peer failed, which
// the worker's parts then each react to (PeerEvents).
//
// Thread: the worker's.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>

#include "core/address.h"
#include "core/config.h"
#include "core/messages.h"
#include "core/peer.h"
#include "core/rails.h"
#include "core/region_table.h"
#include "engine/completions.h"
#include "engine/control_channel.h"

namespace p2p::engine {

using namespace core;

class PeerEvents {
 public:
  virtual ~PeerEvents() = default;
  // p answered as itself: what waited on its answer goes on.
  virtual void peer_ready(Peer& p) = 0;
  // p failed: everything of ours that involves it reacts (transfers, routes, ops, regions).
  virtual void peer_failed(const PeerFailure& f) = 0;
};

class Peers {
 public:
  // How long a peer whose connection was lost under an op has to answer its check (op_failed).
  static constexpr double kLostConnectionCheckS = 1.0;
  // How an address reached peer_for(): a transfer's handle, connect(), or the process's own HELLO.
  enum class Contact : uint8_t { Implicit, Connect, Introduction };

  Peers(const Config& config, Reports& reports, PeerEvents& events) : config_(config), reports_(reports), events_(events) {}
  ~Peers();
  // Once the rails are open: where we are, and what peers are told of us.
  void open(Rails& rails, ControlChannel& control, const RegionTable& regions, std::string provider,
            std::string address, uint64_t incarnation);

  Peer* peer_for(const std::string& address_bytes, Contact how);
  Peer* find(uint64_t incarnation);
  template <typename F>
  void each(const F& f) {
    for (auto& [inc, p] : peers_) f(*p);
  }

  void connect(uint64_t id, const std::string& address);
  void disconnect(uint64_t id, const std::string& address);
  void on_hello(const MsgHeader& h, const Hello& m);
  void on_hello_ack(const MsgHeader& h, const HelloAck& m);
  void on_bye(Peer& p, bool closing);
  // One of our ops to p failed (hello: a HELLO): a check finds out whether p is still there.
  void op_failed(Peer& p, bool hello, int err, const Status& status);
  void fail(Peer& p, Status why, PeerState state = PeerState::Dead);
  // Tears down the connections to p on every rail (Rail::cut): the provider flushes what is
  // posted to it, and nothing queued for it goes out later. An address a live peer shares (a
  // process restarted there) is left alone; failed peers sharing one get the new entries.
  void cut(Peer& p);
  // Nothing of p's failed contact is out any more: a contact asked for meanwhile begins.
  void drained(Peer& p);

  // Something now waits on p (a transfer, a job serving it, a message); end_work(): it is over,
  // and a disconnect() waiting for it goes on.
  void begin_work(Peer& p);
  void end_work(Peer& p);
  // p's exit fails its transfers at once (same host only), through a pidfd.
  void watch_process(Peer& p);
  // Liveness checks and watched processes, from the worker's timers.
  void tick();

  // Closing: waiters end (connects with `closed`, disconnects succeed); goodbyes are queued.
  void close(const Status& closed);
  void say_goodbye();

  template <typename M>
  ByteWriter message(const M& m, const Peer& to) const {
    return encode_message(m, incarnation_, to.incarnation);
  }
  // farewell: sent even though the peer is already marked Left (a BYE).
  void send(Peer& p, ByteWriter&& w, OpOwner* owner = nullptr, bool farewell = false) {
    control_->queue(p, std::move(w), owner, farewell);
  }

 private:
  Peer* find_peer(const std::string& address_bytes, Contact how);  // peer_for without its cache
  void readdress(Peer& p, EngineAddress a, const std::string& address_bytes);
  void revive(Peer& p);
  void send_hello(Peer& p);
  void check(Peer& p, double deadline);
  void hello_failed(Peer& p, int err, const Status& status);
  void ready(Peer& p);
  void finish_disconnect(Peer& p);
  void check_processes();  // of the peers watch_process() watches

  const Config& config_;
  Reports& reports_;
  PeerEvents& events_;
  Rails* rails_ = nullptr;
  ControlChannel* control_ = nullptr;
  const RegionTable* regions_ = nullptr;
  std::string provider_;
  std::string address_;
  uint64_t incarnation_ = 0;
  std::unordered_map<uint64_t, std::unique_ptr<Peer>> peers_;  // by incarnation; never erased
  Peer* last_peer_ = nullptr;  // peer_for's cache
};

}  // namespace p2p::engine
