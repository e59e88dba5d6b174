// kvrelay._ucx objects: UCX's Context -> Worker -> Endpoint -> RemoteKey and
// Context -> MemRegion, each holding its parent so that a parent is never
// destroyed under a live child; plus the polling helpers every wait uses.
// Included by ucx_binding.cpp only (one translation unit).
#pragma once

#include <pybind11/pybind11.h>
#include <ucp/api/ucp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace py = pybind11;

namespace kvrelay::ucx {
namespace {

using Clock = std::chrono::steady_clock;

struct UcxError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

[[noreturn]] void fail(const std::string& what, ucs_status_t status) {
  throw UcxError(what + ": " + ucs_status_string(status) + " (" + std::to_string(status) + ")");
}

void check(ucs_status_t status, const std::string& what) {
  if (status != UCS_OK) fail(what, status);
}

// Adaptive back-off of a polling loop: spin a little (completions of shm/cma
// arrive within microseconds), then sleep, doubling up to `max_us`, so an
// idle wait costs almost no CPU on a shared machine.
struct Backoff {
  int max_us = 1000;
  int idle = 0;
  int sleep_us = 0;
  void reset() { idle = sleep_us = 0; }
  void pause() {
    if (++idle < 64) return;
    sleep_us = std::min(max_us, sleep_us == 0 ? 10 : 2 * sleep_us);  // 10 us, doubling
    std::this_thread::sleep_for(std::chrono::microseconds(sleep_us));
  }
};

Clock::time_point deadline_after(double seconds) {
  const double capped = std::clamp(seconds, 0.0, 1e6);
  return Clock::now() + std::chrono::microseconds(static_cast<int64_t>(capped * 1e6));
}

class Context {
 public:
  // `defaults`: UCX settings (names without the UCX_ prefix) applied unless
  // the environment sets them, so a user's UCX_* variable always wins.
  explicit Context(const std::map<std::string, std::string>& defaults = {}) {
    ucp_config_t* config = nullptr;
    check(ucp_config_read(nullptr, nullptr, &config), "ucp_config_read");
    for (const auto& [name, value] : defaults) {
      if (std::getenv(("UCX_" + name).c_str()) != nullptr) continue;
      const ucs_status_t set = ucp_config_modify(config, name.c_str(), value.c_str());
      if (set != UCS_OK) {
        ucp_config_release(config);
        fail("UCX setting " + name + "=" + value, set);
      }
    }
    ucp_params_t params{};
    params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
    params.features = UCP_FEATURE_RMA;
    params.mt_workers_shared = 1;
    const ucs_status_t status = ucp_init(&params, config, &handle_);
    ucp_config_release(config);
    check(status, "ucp_init");
  }
  ~Context() { close(); }
  void close() {
    if (handle_ != nullptr) {
      ucp_cleanup(handle_);
      handle_ = nullptr;
    }
  }
  ucp_context_h get() const {
    if (handle_ == nullptr) throw UcxError("the UCX context is closed");
    return handle_;
  }
  bool closed() const { return handle_ == nullptr; }

 private:
  ucp_context_h handle_ = nullptr;
};

class Worker {
 public:
  explicit Worker(std::shared_ptr<Context> ctx) : ctx_(std::move(ctx)) {
    ucp_worker_params_t params{};
    params.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    // A reader thread and the progress thread both drive this worker.
    params.thread_mode = UCS_THREAD_MODE_MULTI;
    check(ucp_worker_create(ctx_->get(), &params, &handle_), "ucp_worker_create");
  }
  ~Worker() { close(); }
  void close() {
    if (handle_ != nullptr && !ctx_->closed()) ucp_worker_destroy(handle_);
    handle_ = nullptr;
  }
  ucp_worker_h get() const {
    if (handle_ == nullptr) throw UcxError("the UCX worker is closed");
    return handle_;
  }
  bool closed() const { return handle_ == nullptr; }
  const std::shared_ptr<Context>& context() const { return ctx_; }

  py::bytes address() {
    ucp_address_t* addr = nullptr;
    size_t len = 0;
    check(ucp_worker_get_address(get(), &addr, &len), "ucp_worker_get_address");
    py::bytes out(reinterpret_cast<const char*>(addr), len);
    ucp_worker_release_address(handle_, addr);
    return out;
  }

  // Progresses for up to `seconds` (GIL released); returns the number of
  // events. Used by the thread that serves peers over transports (tcp) whose
  // RMA is emulated with messages and so needs the target to progress.
  unsigned progress_for(double seconds) {
    ucp_worker_h w = get();
    unsigned total = 0;
    py::gil_scoped_release nogil;
    const auto deadline = deadline_after(seconds);
    // An idle agent's progress thread wakes at most every 5 ms (a 1 ms cap
    // cost about 4% of a core per idle agent); it spins again once busy.
    Backoff backoff{5000};
    while (Clock::now() < deadline) {
      if (waiters_.load() > 0) {
        // A batch waiter progresses the worker itself; a second thread in
        // ucp_worker_progress would only contend for the worker's lock (it
        // halves cma throughput on two cores). Sleep until the last waiter
        // leaves (or 5 ms, which also bounds a wake-up lost to the race
        // between the check and the wait) rather than waking every 200 us
        // on a core the batch's copy may need.
        const auto until = std::min(deadline, Clock::now() + std::chrono::milliseconds(5));
        std::unique_lock<std::mutex> lock(waiters_mutex_);
        waiters_left_.wait_until(lock, until, [this] { return waiters_.load() == 0; });
        continue;
      }
      const unsigned n = ucp_worker_progress(w);
      total += n;
      if (n > 0) {
        backoff.reset();
      } else {
        backoff.pause();
      }
    }
    return total;
  }

  // Threads inside Batch::wait; the progress thread stands aside meanwhile.
  std::atomic<int> waiters_{0};
  std::mutex waiters_mutex_;
  std::condition_variable waiters_left_;

 private:
  std::shared_ptr<Context> ctx_;
  ucp_worker_h handle_ = nullptr;
};

struct WaiterScope {
  explicit WaiterScope(Worker& worker) : worker_(worker) { ++worker_.waiters_; }
  ~WaiterScope() {
    if (--worker_.waiters_ == 0) worker_.waiters_left_.notify_all();
  }
  Worker& worker_;
};

// Waits for one request (a flush or a close) until the deadline.
ucs_status_t wait_request(ucp_worker_h worker, ucs_status_ptr_t req, Clock::time_point deadline,
                          bool* timed_out) {
  *timed_out = false;
  if (req == nullptr) return UCS_OK;
  if (UCS_PTR_IS_ERR(req)) return UCS_PTR_STATUS(req);
  Backoff backoff;
  ucs_status_t status;
  while ((status = ucp_request_check_status(req)) == UCS_INPROGRESS) {
    if (Clock::now() >= deadline) {
      *timed_out = true;
      return UCS_ERR_TIMED_OUT;
    }
    ucp_worker_progress(worker) > 0 ? backoff.reset() : backoff.pause();
  }
  ucp_request_free(req);
  return status;
}

class Endpoint {
 public:
  Endpoint(std::shared_ptr<Worker> worker, const std::string& remote_address,
           bool error_handling)
      : worker_(std::move(worker)), error_handling_(error_handling) {
    ucp_ep_params_t params{};
    params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
    params.address = reinterpret_cast<const ucp_address_t*>(remote_address.data());
    // Error handling off on one host: with it on, UCX leaves out the shm/cma
    // lanes. Across hosts it is on, so a failed peer fails its requests and a
    // forced close can complete them.
    params.err_mode = error_handling ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE;
    check(ucp_ep_create(worker_->get(), &params, &handle_), "ucp_ep_create");
  }
  ~Endpoint() {
    if (handle_ != nullptr && !worker_->closed()) {
      try {
        close(true, 0.1);
      } catch (...) {  // destructors must not throw; the worker frees what is left
      }
    }
  }
  // Flush (or with force, drop) outstanding operations and release the
  // endpoint. A forced close completes pending requests with an error.
  void close(bool force, double timeout) {
    if (handle_ == nullptr || worker_->closed()) {
      handle_ = nullptr;
      return;
    }
    ucp_worker_h w = worker_->get();
    ucp_ep_h ep = handle_;
    handle_ = nullptr;
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    // UCX accepts a forced close only with error handling on.
    force = force && error_handling_;
    param.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
    bool timed_out = false;
    ucs_status_t status;
    {
      py::gil_scoped_release nogil;
      status = wait_request(w, ucp_ep_close_nbx(ep, &param), deadline_after(timeout), &timed_out);
      if (timed_out && !force && error_handling_) {
        // The peer does not answer a graceful close: drop the endpoint.
        param.flags = UCP_EP_CLOSE_FLAG_FORCE;
        status = wait_request(w, ucp_ep_close_nbx(ep, &param), deadline_after(timeout),
                              &timed_out);
      }
    }
    if (timed_out)
      throw UcxError("closing the UCX endpoint timed out; the worker reclaims it at teardown");
    if (status != UCS_OK && status != UCS_ERR_CANCELED && status != UCS_ERR_ENDPOINT_TIMEOUT &&
        status != UCS_ERR_CONNECTION_RESET)
      fail("ucp_ep_close_nbx", status);
  }
  bool flush(double timeout) {
    ucp_worker_h w = worker_->get();
    ucp_ep_h ep = get();
    ucp_request_param_t param{};
    bool timed_out = false;
    ucs_status_t status;
    {
      py::gil_scoped_release nogil;
      status = wait_request(w, ucp_ep_flush_nbx(ep, &param), deadline_after(timeout), &timed_out);
    }
    if (timed_out) return false;
    check(status, "ucp_ep_flush_nbx");
    return true;
  }
  ucp_ep_h get() const {
    if (handle_ == nullptr || worker_->closed()) throw UcxError("the UCX endpoint is closed");
    return handle_;
  }
  const std::shared_ptr<Worker>& worker() const { return worker_; }

 private:
  std::shared_ptr<Worker> worker_;
  bool error_handling_;
  ucp_ep_h handle_ = nullptr;
};

class MemRegion {
 public:
  MemRegion(std::shared_ptr<Context> ctx, uintptr_t address, size_t length)
      : ctx_(std::move(ctx)), address_(address), length_(length) {
    if (length == 0) throw py::value_error("cannot register an empty region");
    ucp_mem_map_params_t params{};
    params.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
    params.address = reinterpret_cast<void*>(address);
    params.length = length;
    check(ucp_mem_map(ctx_->get(), &params, &memh_), "ucp_mem_map");
    ucp_mem_attr_t attr{};
    attr.field_mask = UCP_MEM_ATTR_FIELD_MEM_TYPE;
    if (ucp_mem_query(memh_, &attr) == UCS_OK) memory_type_ = attr.mem_type;
  }
  ~MemRegion() { unmap(); }
  void unmap() {
    if (memh_ != nullptr && !ctx_->closed()) ucp_mem_unmap(ctx_->get(), memh_);
    memh_ = nullptr;
  }
  py::bytes pack_rkey() {
    void* buf = nullptr;
    size_t len = 0;
    check(ucp_rkey_pack(ctx_->get(), get(), &buf, &len), "ucp_rkey_pack");
    py::bytes out(static_cast<const char*>(buf), len);
    ucp_rkey_buffer_release(buf);
    return out;
  }
  ucp_mem_h get() const {
    if (memh_ == nullptr) throw UcxError("the memory region is unmapped");
    return memh_;
  }
  bool contains(uintptr_t addr, size_t len) const {
    return addr >= address_ && len <= length_ && addr - address_ <= length_ - len;
  }
  uintptr_t address() const { return address_; }
  size_t length() const { return length_; }
  // Host or GPU, as UCX detected it once at registration; given to every
  // operation so that UCX does not detect it again per run.
  ucs_memory_type_t memory_type() const { return memory_type_; }
  bool mapped() const { return memh_ != nullptr; }

 private:
  std::shared_ptr<Context> ctx_;
  uintptr_t address_;
  size_t length_;
  ucp_mem_h memh_ = nullptr;
  ucs_memory_type_t memory_type_ = UCS_MEMORY_TYPE_UNKNOWN;
};

class RemoteKey {
 public:
  RemoteKey(std::shared_ptr<Endpoint> ep, const std::string& packed) : ep_(std::move(ep)) {
    check(ucp_ep_rkey_unpack(ep_->get(), packed.data(), &rkey_), "ucp_ep_rkey_unpack");
  }
  ~RemoteKey() { destroy(); }
  void destroy() {
    if (rkey_ != nullptr) ucp_rkey_destroy(rkey_);
    rkey_ = nullptr;
  }
  ucp_rkey_h get() const {
    if (rkey_ == nullptr) throw UcxError("the remote key is destroyed");
    return rkey_;
  }
  const std::shared_ptr<Endpoint>& endpoint() const { return ep_; }

 private:
  std::shared_ptr<Endpoint> ep_;
  ucp_rkey_h rkey_ = nullptr;
};

}  // namespace
}  // namespace kvrelay::ucx
