// kvrelay._ucx: a small binding of libucp for one-sided KV pulls.
//
// Objects mirror UCX's own: Context -> Worker -> Endpoint -> RemoteKey, and
// Context -> MemRegion. Each child holds a shared_ptr to its parent, so a
// parent is never destroyed under a live child; Python tears them down in the
// order UCX wants (rkeys, unmap, endpoints, worker, context) with close().
//
// Blocking work (waiting for a batch, closing an endpoint, progressing) runs
// with the GIL released, polls ucp_worker_progress and sleeps when nothing
// happens so that two processes on two cores do not starve each other, and
// always ends at a deadline. Failures become kvrelay._ucx.UcxError carrying
// the UCX status name.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <sys/eventfd.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <memory>
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
// arrive within microseconds), then sleep up to 1 ms so an idle wait costs
// almost no CPU on a shared machine.
struct Backoff {
  int idle = 0;
  void reset() { idle = 0; }
  void pause() {
    ++idle;
    if (idle < 64) return;
    const int us = std::min(1000, 10 * (idle - 63));
    std::this_thread::sleep_for(std::chrono::microseconds(us));
  }
};

Clock::time_point deadline_after(double seconds) {
  const double capped = std::clamp(seconds, 0.0, 1e6);
  return Clock::now() + std::chrono::microseconds(static_cast<int64_t>(capped * 1e6));
}

class Context {
 public:
  Context() {
    ucp_config_t* config = nullptr;
    check(ucp_config_read(nullptr, nullptr, &config), "ucp_config_read");
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
    Backoff backoff;
    while (Clock::now() < deadline) {
      if (waiters_.load() > 0) {
        // A batch waiter progresses the worker itself; a second thread in
        // ucp_worker_progress would only contend for the worker's lock (it
        // halves cma throughput on two cores).
        std::this_thread::sleep_for(std::chrono::microseconds(200));
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

 private:
  std::shared_ptr<Context> ctx_;
  ucp_worker_h handle_ = nullptr;
};

struct WaiterScope {
  explicit WaiterScope(std::atomic<int>& count) : count_(count) { ++count_; }
  ~WaiterScope() { --count_; }
  std::atomic<int>& count_;
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
  bool mapped() const { return memh_ != nullptr; }

 private:
  std::shared_ptr<Context> ctx_;
  uintptr_t address_;
  size_t length_;
  ucp_mem_h memh_ = nullptr;
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

using U64Array = py::array_t<uint64_t, py::array::c_style | py::array::forcecast>;

// A batch of GETs or PUTs posted in one call, then waited for. The posted
// requests write into (GET) or read from (PUT) the caller's local buffers
// until wait() returns true or the endpoint is force-closed.
class Batch {
 public:
  Batch(std::shared_ptr<RemoteKey> rkey, std::shared_ptr<MemRegion> local, bool get,
        const U64Array& remote, const U64Array& local_addr, const U64Array& lengths)
      : rkey_(std::move(rkey)), local_(std::move(local)) {
    const auto n = static_cast<size_t>(remote.size());
    if (remote.ndim() != 1 || local_addr.ndim() != 1 || lengths.ndim() != 1 ||
        static_cast<size_t>(local_addr.size()) != n || static_cast<size_t>(lengths.size()) != n)
      throw py::value_error("remote, local and lengths must be 1-d arrays of one length");
    const uint64_t* r = remote.data();
    const uint64_t* l = local_addr.data();
    const uint64_t* len = lengths.data();
    // The local side is checked here; the remote runs were checked against
    // the peer's arena table before this call (the rkey alone bounds nothing
    // on cma, which reads any address of the peer).
    for (size_t i = 0; i < n; ++i) {
      if (!local_->contains(l[i], len[i]))
        throw py::index_error("local run " + std::to_string(i) + " is outside the local region");
    }
    const std::shared_ptr<Endpoint>& ep = rkey_->endpoint();
    worker_obj_ = ep->worker();
    worker_ = worker_obj_->get();
    ucp_ep_h ep_h = ep->get();
    ucp_rkey_h rk = rkey_->get();
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_MEMH;
    param.memh = local_->get();
    py::gil_scoped_release nogil;
    WaiterScope scope(worker_obj_->waiters_);
    pending_.reserve(n + 1);
    for (size_t i = 0; i < n && status_ == UCS_OK; ++i) {
      void* buf = reinterpret_cast<void*>(l[i]);
      ucs_status_ptr_t req = get ? ucp_get_nbx(ep_h, buf, len[i], r[i], rk, &param)
                                 : ucp_put_nbx(ep_h, buf, len[i], r[i], rk, &param);
      track(req);
    }
    if (!get && status_ == UCS_OK) {
      // A PUT completes locally first; the flush completes when the data has
      // reached the peer's memory.
      ucp_request_param_t flush_param{};
      track(ucp_ep_flush_nbx(ep_h, &flush_param));
    }
  }
  ~Batch() {
    release();
    if (event_fd_ >= 0) close(event_fd_);
  }

  // True once every operation completed; False at the deadline or after
  // abort(). Raises UcxError if an operation failed.
  bool wait(double timeout) {
    if (waiter_.joinable()) throw UcxError("the batch is already being waited for by start()");
    {
      py::gil_scoped_release nogil;
      drive(timeout);
    }
    if (status_ != UCS_OK) fail("batched transfer", status_);
    return pending_.empty();
  }

  // Waits on a thread of its own (no GIL, no executor hop) and signals the
  // returned eventfd when done, at the deadline or after abort(); an asyncio
  // loop watches the fd and then calls result().
  int start(double timeout) {
    if (waiter_.joinable() || event_fd_ >= 0) throw UcxError("the batch was already started");
    event_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (event_fd_ < 0) throw UcxError(std::string("eventfd: ") + std::strerror(errno));
    waiter_ = std::thread([this, timeout] {
      drive(timeout);
      const uint64_t one = 1;
      [[maybe_unused]] ssize_t n = write(event_fd_, &one, sizeof(one));
    });
    return event_fd_;
  }

  // After start()'s fd fired: True when every operation completed.
  bool result() {
    join();
    if (status_ != UCS_OK) fail("batched transfer", status_);
    return pending_.empty();
  }

  void abort() { aborted_.store(true); }
  size_t pending() const { return pending_.size(); }

  // After a forced close of the endpoint every request has completed (with an
  // error); reap them so none is leaked.
  void release() {
    aborted_.store(true);
    join();
    if (pending_.empty() || worker_ == nullptr) return;
    for (void* req : pending_) {
      if (ucp_request_check_status(req) != UCS_INPROGRESS) ucp_request_free(req);
      // A request still in progress here belongs to an endpoint that was not
      // closed; the worker reclaims it when it is destroyed.
    }
    pending_.clear();
  }

 private:
  void drive(double timeout) {
    WaiterScope scope(worker_obj_->waiters_);
    const auto deadline = deadline_after(timeout);
    Backoff backoff;
    while (!pending_.empty() && !aborted_.load()) {
      const unsigned events = ucp_worker_progress(worker_);
      reap();
      if (pending_.empty() || Clock::now() >= deadline) break;
      events > 0 ? backoff.reset() : backoff.pause();
    }
  }
  void join() {
    if (waiter_.joinable()) {
      py::gil_scoped_release nogil;
      waiter_.join();
    }
  }
  void track(ucs_status_ptr_t req) {
    if (req == nullptr) return;  // completed in place
    if (UCS_PTR_IS_ERR(req)) {
      status_ = UCS_PTR_STATUS(req);
      return;
    }
    pending_.push_back(req);
  }
  void reap() {
    auto keep = pending_.begin();
    for (void* req : pending_) {
      const ucs_status_t s = ucp_request_check_status(req);
      if (s == UCS_INPROGRESS) {
        *keep++ = req;
        continue;
      }
      if (s != UCS_OK && status_ == UCS_OK) status_ = s;
      ucp_request_free(req);
    }
    pending_.erase(keep, pending_.end());
  }

  std::shared_ptr<RemoteKey> rkey_;
  std::shared_ptr<MemRegion> local_;
  std::shared_ptr<Worker> worker_obj_;
  ucp_worker_h worker_ = nullptr;
  std::vector<void*> pending_;
  ucs_status_t status_ = UCS_OK;
  std::atomic<bool> aborted_{false};
  std::thread waiter_;
  int event_fd_ = -1;
};

std::string version() {
  unsigned major = 0, minor = 0, release = 0;
  ucp_get_version(&major, &minor, &release);
  return std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(release);
}

}  // namespace
}  // namespace kvrelay::ucx

PYBIND11_MODULE(_ucx, m) {
  using namespace kvrelay::ucx;
  m.doc() = "kvrelay's binding of libucp: one-sided GET/PUT between registered arenas";
  py::register_exception<UcxError>(m, "UcxError", PyExc_RuntimeError);
  m.def("version", &version, "version of the libucp loaded at run time");

  py::class_<Context, std::shared_ptr<Context>>(m, "Context")
      .def(py::init<>(), "ucp_init with the RMA feature; UCX_* variables configure it")
      .def("close", &Context::close);
  py::class_<Worker, std::shared_ptr<Worker>>(m, "Worker")
      .def(py::init<std::shared_ptr<Context>>())
      .def("address", &Worker::address)
      .def("progress_for", &Worker::progress_for, py::arg("seconds"))
      .def("close", &Worker::close);
  py::class_<Endpoint, std::shared_ptr<Endpoint>>(m, "Endpoint")
      .def(py::init<std::shared_ptr<Worker>, std::string, bool>(), py::arg("worker"),
           py::arg("remote_address"), py::arg("error_handling"))
      .def("flush", &Endpoint::flush, py::arg("timeout"))
      .def("close", &Endpoint::close, py::arg("force"), py::arg("timeout"));
  py::class_<MemRegion, std::shared_ptr<MemRegion>>(m, "MemRegion")
      .def(py::init<std::shared_ptr<Context>, uintptr_t, size_t>(), py::arg("context"),
           py::arg("address"), py::arg("length"))
      .def("pack_rkey", &MemRegion::pack_rkey)
      .def("unmap", &MemRegion::unmap)
      .def_property_readonly("mapped", &MemRegion::mapped)
      .def_property_readonly("address", &MemRegion::address)
      .def_property_readonly("length", &MemRegion::length);
  py::class_<RemoteKey, std::shared_ptr<RemoteKey>>(m, "RemoteKey")
      .def(py::init<std::shared_ptr<Endpoint>, std::string>(), py::arg("endpoint"),
           py::arg("packed"))
      .def("destroy", &RemoteKey::destroy);
  py::class_<Batch, std::shared_ptr<Batch>>(m, "Batch")
      .def(py::init<std::shared_ptr<RemoteKey>, std::shared_ptr<MemRegion>, bool, const U64Array&,
                    const U64Array&, const U64Array&>(),
           py::arg("rkey"), py::arg("local"), py::arg("get"), py::arg("remote"),
           py::arg("local_addr"), py::arg("lengths"),
           "post one GET (get=True) or PUT per (remote, local, length) triple")
      .def("wait", &Batch::wait, py::arg("timeout"))
      .def("start", &Batch::start, py::arg("timeout"),
           "wait on a thread of the batch's own; returns an eventfd that fires when done")
      .def("result", &Batch::result)
      .def("abort", &Batch::abort)
      .def("release", &Batch::release)
      .def_property_readonly("pending", &Batch::pending);
}
