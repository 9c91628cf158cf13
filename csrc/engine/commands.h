// Commands: what Python threads ask of the worker, queued by Worker::post and run on the worker
// thread in order (Worker::execute). A command still queued when the worker stops only fails
// its operation with ClosedError.
#pragma once

#include <cstdint>
#include <functional>
#include <future>
#include <memory>
#include <string>
#include <variant>

#include "core/route.h"
#include "core/transfer.h"

namespace p2p::engine {

using namespace core;

class Worker;

struct StartTransfer {  // write_slices, read_slices or send: the worker owns the transfer
  std::unique_ptr<Transfer> transfer;
};
struct Connect {
  uint64_t id;
  std::string address;
};
struct Disconnect {
  uint64_t id;
  std::string address;
};
struct Receive {
  uint64_t id;
  double timeout_s;
};
struct AwaitNotification {
  uint64_t id;
  uint32_t tag;
  double timeout_s;
};
struct Cancel {
  uint64_t id;
};
using StreamOrderAnswer = std::shared_ptr<std::promise<StreamOrder>>;
// Anything else (register, deregister, route): runs fn(worker, closed), which answers its
// caller itself (Worker::call).
struct Call {
  std::function<void(Worker&, bool closed)> fn;
};

using Command = std::variant<StartTransfer, Connect, Disconnect, Receive, AwaitNotification, Cancel, Call>;

}  // namespace p2p::engine
