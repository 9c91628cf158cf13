#include "core/rails.h"

#include <unistd.h>

#include <rdma/fi_errno.h>

#include <algorithm>

#include "common/log.h"

namespace p2p::core {

Rails::Rails(const Config& config, const fabric::Offer& offer, const cpu_set_t& node_cpus, int wake_fd,
             std::atomic<bool>* worker_sleeping)
    : config_(config), striper_(config.min_chunk, config.max_chunk) {
  P2P_CHECK(!config.domains.empty(), ErrorKind::Value, "no rails: the domain list is empty");
  size_t total_depth = 0;
  for (size_t i = 0; i < config.domains.size(); ++i) {
    const std::string& name = config.domains[i];
    const fi_info* info = offer.domain(name);
    if (!info) {
      std::string offered;
      for (const auto& nic : offer.nics()) offered += (offered.empty() ? "" : ", ") + nic.domain;
      P2P_THROW(ErrorKind::Value, "provider ", offer.provider, " has no domain '", name, "'; it offers: ", offered);
    }
    RailState rs;
    const size_t provider_depth = info->tx_attr->size ? info->tx_attr->size : 1024;
    rs.depth = std::min<size_t>(config.tx_depth ? config.tx_depth : 1024, provider_depth);
    const size_t cq_size = 2 * (rs.depth + (i == 0 ? config.recv_buffers + config.send_buffers : 0)) + 64;
    const uint16_t port = config.port ? static_cast<uint16_t>(config.port + i) : 0;
    rs.rail = std::make_unique<fabric::Rail>(info, cq_size, port, offer.options);
    facts_.push_back({name, info->fabric_attr->name, rs.depth, rs.rail->wait_fd() >= 0, rs.rail->cuda_ipc()});
    total_depth += rs.depth;
    rails_.push_back(std::move(rs));
  }
  start_drivers(offer.auto_progress, node_cpus, wake_fd, worker_sleeping);
  // Ops for RMA and sends: two per posting credit, so that queues can be filled while the
  // posted half is in flight.
  pool_ = std::make_unique<OpPool>(2 * total_depth + config.send_buffers);
}

Rails::~Rails() { close(); }

// NOTE: with one thread posting for every rail, tcp plateaus at about one stream's
// bandwidth (50 Gbps for 1, 2, 4 and 8 rails on the GPU machine, against 232 Gbps for 8
// plain TCP streams): its provider copies each send into the kernel on the posting thread.
// Drivers shard the posting per rail. Only for thread-safe (auto progress) domains.
void Rails::start_drivers(bool auto_progress, const cpu_set_t& node_cpus, int wake_fd,
                          std::atomic<bool>* worker_sleeping) {
  const int wanted = config_.rail_threads < 0 ? (auto_progress ? static_cast<int>(rails_.size()) : 0) : config_.rail_threads;
  if (wanted <= 0) return;
  P2P_CHECK(auto_progress, ErrorKind::Value, "rail threads need a thread-safe provider (tcp with auto progress)");
  const size_t n = std::min<size_t>(wanted, rails_.size());
  std::vector<fabric::Rail*> rails;
  for (auto& rs : rails_) rails.push_back(rs.rail.get());
  for (size_t d = 0; d < n; ++d) {
    std::vector<uint16_t> mine;
    size_t capacity = config_.recv_buffers + config_.send_buffers;
    for (size_t r = d; r < rails_.size(); r += n) {
      mine.push_back(static_cast<uint16_t>(r));
      capacity += 2 * rails_[r].depth;
    }
    cpu_set_t cpus = node_cpus;
    if (config_.cpu >= 0 && CPU_COUNT(&cpus) > 1) CPU_CLR(config_.cpu, &cpus);  // the worker's own core
    // NOTE: drivers sleep after a millisecond idle even beside a pinned worker that always
    // spins: a CUDA engine on tcp whose peers take the IPC route would otherwise keep a core per
    // rail busy doing nothing (8 per GPU engine on the 32-core GPU machine).
    drivers_.push_back(std::make_unique<RailDriver>(rails, mine, capacity, config_.batch, 1000,
                                                    config_.peer_timeout_s / 2, wake_fd,
                                                    worker_sleeping, cpus, cat("p2p-rail", d)));
    for (uint16_t r : mine) rails_[r].driver = drivers_.back().get();
  }
}

Op* Rails::new_op(OpKind kind, uint16_t rail, OpOwner* owner, Peer* peer) {
  Op* op = pool_->acquire();
  if (!op) return nullptr;
  op->kind = kind;
  op->rail = rail;
  op->owner = owner;
  op->peer = peer;
  return op;
}

// ---------------------------------------------------------------------------------------------
// Completions.

bool Rails::poll(OpSink& sink) {
  bool any = false;
  for (auto& d : drivers_) {
    any |= d->drain([&](const RailDriver::Event& e) {
      if (e.error) {
        sink.failed(e.op, e.error, e.prov_errno, *e.message);
        delete e.message;
      } else {
        sink.completed(e.op, e.len);
      }
    });
  }
  for (auto& rs : rails_)
    if (!rs.driver) any |= drain(*rs.rail, 4, sink);
  return any;
}

bool Rails::drain(fabric::Rail& rail, int rounds, OpSink& sink) {
  return rail.drain(
      rounds, [&](void* op, size_t len) { sink.completed(static_cast<Op*>(op), len); },
      [&](const fi_cq_err_entry& err, const std::string& message) {
        if (!err.op_context) {
          P2P_LOG(Warn, "completion error without an operation: ", message);
          return;
        }
        sink.failed(static_cast<Op*>(err.op_context), err.err, err.prov_errno, message);
      });
}

void Rails::post_receive(Op* op, OpSink& sink) {
  if (RailDriver* driver = rails_[0].driver) {
    op->rail = 0;
    if (!driver->submit(op)) P2P_LOG(Error, "could not hand a receive buffer to its rail thread");
    driver->kick();
    return;
  }
  ssize_t rc;
  while ((rc = rails_[0].rail->recv(op->iov[0].iov_base, op->iov[0].iov_len, op->desc[0], &op->ctx)) == -FI_EAGAIN)
    drain(*rails_[0].rail, 1, sink);  // the provider's receive queue is full: take what completed
  if (rc < 0) P2P_LOG(Error, "could not post a receive buffer: ", fi_error_name(-rc));
}

// ---------------------------------------------------------------------------------------------
// Posting: per rail, up to `batch` ops, FI_MORE on all but the last (the doorbell rings on
// the last one); an op refused with -FI_EAGAIN goes back to the front of its queue, and ops to
// other peers pass it (post_queue).
//
// NOTE: a batch never exceeds the rail's free credits (our count of posted ops against its
// tx queue size), so -FI_EAGAIN after FI_MORE posts, which could leave a batch without its
// doorbell until the next post, comes only from a peer whose connection is full;
// TORCH_P2P_POST_BATCH=1 turns batching off.

bool Rails::post(OpSink& sink) {
  bool any = send_forgets();
  for (auto& rs : rails_) {
    if (rs.driver) {
      any |= hand_over(rs, sink);
      continue;
    }
    const size_t budget = std::min(config_.batch, rs.depth - std::min(rs.depth, rs.inflight));
    post_queue(*rs.rail, rs.pending, budget, [&](Op& op) { return sink.usable(&op); }, [&](Op& op, ssize_t rc) {
      any = true;
      if (rc == 0) {
        op.posted = true;
        ++rs.inflight;
        return;
      }
      std::string who = op.peer ? cat(" to peer ", hex(op.peer->incarnation)) : std::string();
      sink.complete(&op, Status::error(ErrorKind::Generic, cat("posting a ", op_name(op.kind), who, " on ",
                                                               rs.rail->domain_name(), " failed: ", fi_error_name(-rc))));
    });
  }
  return any;
}

// Ops for a driven rail go to its driver, as many as the rail has credits for; not while the
// driver still has to hear that a peer failed (it would drop ops to the peer revived).
bool Rails::hand_over(RailState& rs, OpSink& sink) {
  for (auto& f : forgets_)
    if (f.first == rs.driver) return false;
  bool any = false;
  while (rs.inflight < rs.depth && !rs.pending.empty()) {
    Op* op = rs.pending.front();
    if (!sink.usable(op)) {
      rs.pending.pop_front();
      continue;
    }
    if (!rs.driver->submit(op)) break;
    rs.pending.pop_front();
    op->posted = true;
    ++rs.inflight;
    any = true;
  }
  if (any) rs.driver->kick();
  return any;
}

size_t Rails::forget(Peer* p) {
  for (auto& d : drivers_) forgets_.push_back({d.get(), p});  // at the rail threads' next turn
  return drivers_.size();
}

// Tells the rail threads about failed peers (Forget markers), in order with the ops handed over.
bool Rails::send_forgets() {
  size_t kept = 0;
  for (auto& [driver, peer] : forgets_) {
    Op* marker = new_op(OpKind::Forget, 0, nullptr, peer);
    if (marker && driver->submit(marker)) {
      driver->kick();
      continue;
    }
    if (marker) pool_->release(marker);
    forgets_[kept++] = {driver, peer};
  }
  const bool any = kept < forgets_.size();
  forgets_.resize(kept);
  return any;
}

// ---------------------------------------------------------------------------------------------
// Registration, addresses, sleeping, closing.

void Rails::register_memory(uint8_t* ptr, uint64_t nbytes, uint64_t piece, uint64_t access, int cuda_device,
                            std::vector<fabric::MrHandle>& mrs, const DmaBufOf& dmabuf) {
  for (uint64_t off = 0; off < nbytes; off += piece) {
    const uint64_t len = std::min<uint64_t>(piece, nbytes - off);
    const fabric::DmaBuf buf = dmabuf ? dmabuf(ptr + off, len) : fabric::DmaBuf{};
    try {
      for (auto& rs : rails_)
        mrs.push_back(rs.rail->register_memory(ptr + off, len, access, cuda_device, buf.fd >= 0 ? &buf : nullptr));
    } catch (...) {
      if (buf.fd >= 0) ::close(buf.fd);
      throw;
    }
    if (buf.fd >= 0) ::close(buf.fd);  // the registrations hold the dma-buf itself
  }
}

void Rails::deregister(std::vector<fabric::MrHandle>& mrs) {
  for (size_t k = 0; k < mrs.size(); ++k) rails_[k % rails_.size()].rail->deregister(mrs[k]);
}

std::vector<fi_addr_t> Rails::insert(const std::vector<std::string>& rails) {
  std::vector<fi_addr_t> fi;
  fi.reserve(rails_.size() * rails.size());
  for (auto& rs : rails_)
    for (const std::string& rail : rails) fi.push_back(rs.rail->insert(rail));
  return fi;
}

bool Rails::events_waiting() const {
  return std::any_of(drivers_.begin(), drivers_.end(), [](auto& d) { return d->has_events(); });
}

bool Rails::all_wait_fds() const {
  return std::all_of(rails_.begin(), rails_.end(), [](auto& rs) { return rs.driver || rs.rail->wait_fd() >= 0; });
}

std::vector<int> Rails::wait_fds() const {
  std::vector<int> fds;
  for (auto& rs : rails_)
    if (!rs.driver && rs.rail->wait_fd() >= 0) fds.push_back(rs.rail->wait_fd());
  return fds;
}

bool Rails::trywait() {
  bool can = true;
  for (auto& rs : rails_) can = can && (rs.driver || rs.rail->trywait());
  return can;
}

void Rails::close() {
  for (auto& d : drivers_) d->drain([](const RailDriver::Event& e) { delete e.message; });
  drivers_.clear();  // joins the rail threads before their rails go
  rails_.clear();    // closes the endpoints
}

}  // namespace p2p::core
