// The worker's start-up: pin to the GPU's NUMA node, open the rails there, probe what the
// provider really supports, start the rail threads, size the pools and post the receives.
#include "engine/worker.h"

#include <pthread.h>
#include <sched.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/random.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "common/log.h"
#include "core/host.h"
#include "routes/registry.h"

namespace p2p::engine {

// ---------------------------------------------------------------------------------------------
// Set-up, as named steps. Everything opens on the worker core's NUMA node, so that libfabric's
// and CUDA's memory lands there, and only then is the worker narrowed to its core. NOTE: threads
// inherit their creator's affinity: providers' own threads (tcp runs one per rail) and the rail
// drivers, created meanwhile, get the node, not one core.
void Worker::open(std::promise<void>& ready) {
  move_to_node();
  copier_ = make_copier(config_.cuda_device);
  host_ = host_identity();
  routes_ = routes::make_routes(*this, config_, host_);
  wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  epoll_fd_ = epoll_create1(EPOLL_CLOEXEC);
  P2P_CHECK(wake_fd_ >= 0 && epoll_fd_ >= 0, ErrorKind::Generic, "eventfd/epoll: ", std::strerror(errno));
  const size_t total_depth = open_rails();
  if (config_.cuda_device >= 0 && hmem_ && config_.data_path == DataPath::Auto) probe_hmem();
  publish_address();
  start_drivers();
  // Ops for RMA and sends: two per posting credit, so that queues can be filled while the
  // posted half is in flight.
  pool_ = std::make_unique<OpPool>(2 * total_depth + config_.send_buffers);
  open_control_buffers();
  watch_fds();
  pthread_setname_np(pthread_self(), "p2p-worker");
  pin_to_core();
  ready.set_value();
}

void Worker::move_to_node() {
  sched_getaffinity(0, sizeof process_cpus_, &process_cpus_);
  node_cpus_ = process_cpus_;
  if (config_.cpu >= 0 && !config_.node_cpus.empty()) {
    CPU_ZERO(&node_cpus_);
    for (int c : config_.node_cpus)
      if (c >= 0 && c < CPU_SETSIZE && CPU_ISSET(c, &process_cpus_)) CPU_SET(c, &node_cpus_);
    if (!CPU_ISSET(config_.cpu, &node_cpus_)) node_cpus_ = process_cpus_;
  }
  if (config_.cpu >= 0) {
    pthread_setaffinity_np(pthread_self(), sizeof node_cpus_, &node_cpus_);
  }
}

// Opens one Rail per configured domain of the provider set-up queried; returns their posting
// depth.
size_t Worker::open_rails() {
  const bool cuda = config_.cuda();
  const fabric::Offer& offer = *offer_;
  provider_ = offer.provider;
  hmem_ = offer.hmem;
  delivery_complete_ = offer.delivery_complete;
  auto_progress_ = offer.auto_progress;
  P2P_CHECK(!(cuda && config_.data_path == DataPath::Direct && !hmem_), ErrorKind::Value,
            "data_path='direct' needs a provider with FI_HMEM (GPUDirect RDMA), but ", provider_,
            " here has none; use data_path='staged' or None");
  P2P_CHECK(!config_.domains.empty(), ErrorKind::Value, "no rails: the domain list is empty");

  size_t total_depth = 0;
  for (size_t i = 0; i < config_.domains.size(); ++i) {
    const std::string& name = config_.domains[i];
    const fi_info* info = offer.domain(name);
    if (!info) {
      std::string offered;
      for (const auto& nic : offer.nics()) offered += (offered.empty() ? "" : ", ") + nic.domain;
      P2P_THROW(ErrorKind::Value, "provider ", provider_, " has no domain '", name,
                "'; it offers: ", offered);
    }
    RailState rs;
    const size_t provider_depth = info->tx_attr->size ? info->tx_attr->size : 1024;
    rs.depth = std::min<size_t>(config_.tx_depth ? config_.tx_depth : 1024, provider_depth);
    const size_t cq_size = 2 * (rs.depth + (i == 0 ? config_.recv_buffers + config_.send_buffers : 0)) + 64;
    const uint16_t port = config_.port ? static_cast<uint16_t>(config_.port + i) : 0;
    rs.rail = std::make_unique<fabric::Rail>(info, cq_size, port, offer.options);
    rail_facts_.push_back({name, info->fabric_attr->name, rs.depth, rs.rail->wait_fd() >= 0});
    total_depth += rs.depth;
    rails_.push_back(std::move(rs));
  }
  return total_depth;
}

void Worker::publish_address() {
  while (incarnation_ == 0) (void)!getrandom(&incarnation_, sizeof incarnation_, 0);
  EngineAddress me{provider_, incarnation_, {}, host_, static_cast<uint32_t>(getpid())};
  for (auto& rs : rails_) me.rails.push_back(rs.rail->address());
  for (size_t i = 0; i < routes_.size(); ++i) me.routes |= routes_[i]->advertised() << i;
  address_ = me.encode();
}

// Control messages use rail 0 only: receive buffers, then send buffers.
void Worker::open_control_buffers() {
  control_.open(*rails_[0].rail, config_.recv_buffers, config_.send_buffers);
  for (Op& op : control_.receive_ops()) post_receive(&op);
}

// What idle_wait() sleeps on: the wake eventfd and every rail the worker itself polls.
void Worker::watch_fds() {
  epoll_event ev{};
  ev.events = EPOLLIN;
  epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, wake_fd_, &ev);
  for (auto& rs : rails_) {
    if (rs.driver || rs.rail->wait_fd() < 0) continue;
    epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, rs.rail->wait_fd(), &ev);
  }
}

void Worker::pin_to_core() {
  if (config_.cpu < 0) return;
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(config_.cpu, &set);
  if (const int rc = pthread_setaffinity_np(pthread_self(), sizeof set, &set))
    P2P_LOG(Warn, "could not pin the progress thread to cpu ", config_.cpu, ": ", std::strerror(rc));
}

// Some builds grant FI_HMEM and then refuse CUDA memory (Ubuntu's libfabric 1.17 shm). Trying one
// small registration decides the automatic data path honestly, before any user memory.
void Worker::probe_hmem() {
  void* probe = copier_->alloc_device(1 << 16);
  try {
    fabric::MrHandle mr = rails_[0].rail->register_memory(probe, 1 << 16, FI_READ | FI_WRITE, config_.cuda_device);
    rails_[0].rail->deregister(mr);
  } catch (const Error& e) {
    hmem_ = false;
    P2P_LOG(Warn, "provider ", provider_, " offers FI_HMEM but cannot register CUDA memory here (", e.what(),
            "); GPU memory takes the staged path");
  }
  copier_->free_device(probe);
}

// NOTE: with one thread posting for every rail, tcp plateaus at about one stream's
// bandwidth (50 Gbps for 1, 2, 4 and 8 rails on the GPU machine, against 232 Gbps for 8
// plain TCP streams): its provider copies each send into the kernel on the posting thread.
// Drivers shard the posting per rail. Only for thread-safe (auto progress) domains.
void Worker::start_drivers() {
  const int wanted = config_.rail_threads < 0 ? (auto_progress_ ? static_cast<int>(rails_.size()) : 0)
                                              : config_.rail_threads;
  if (wanted <= 0) return;
  P2P_CHECK(auto_progress_, ErrorKind::Value, "rail threads need a thread-safe provider (tcp with auto progress)");
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
    cpu_set_t cpus = node_cpus_;
    if (config_.cpu >= 0 && CPU_COUNT(&cpus) > 1) CPU_CLR(config_.cpu, &cpus);  // the worker's own core
    // NOTE: drivers sleep after a millisecond idle even beside a pinned worker that always
    // spins: a CUDA engine on tcp whose peers take the IPC route would otherwise keep a core per
    // rail busy doing nothing (8 per GPU engine on the 32-core GPU machine).
    drivers_.push_back(std::make_unique<RailDriver>(rails, mine, capacity, config_.batch, 1000, wake_fd_, &sleeping_,
                                                    cpus, cat("p2p-rail", d)));
    for (uint16_t r : mine) rails_[r].driver = drivers_.back().get();
  }
}

}  // namespace p2p::engine
