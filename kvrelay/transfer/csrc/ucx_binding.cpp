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
#include <poll.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <sys/eventfd.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "ucx_driver.h"
#include "ucx_objects.h"
#include "ucx_rows.h"

namespace kvrelay::ucx {
namespace {

// The peer closed the control connection the batch was told to watch.
struct PeerClosed : UcxError {
  using UcxError::UcxError;
};

// True once the peer closed (or reset) the TCP connection `fd`: a hang-up or
// the peer's FIN, without reading anything (data waiting is not a close).
bool hung_up(int fd) {
  pollfd p{fd, POLLRDHUP, 0};
  return poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) != 0;
}

// A batch of GETs or PUTs posted in one call, then waited for. The posted
// requests write into (GET) or read from (PUT) the caller's local buffers
// until wait() returns true or the endpoint is force-closed.
class Batch : public std::enable_shared_from_this<Batch> {
 public:
  // `rows` is the agent's plan: a buffer of native uint64 (remote offset,
  // local offset, length) triples (the planner's bytearray, or a (k, 3)
  // uint64 array), offsets from `remote_base` in the peer and from the local
  // region's start. Taken as a plain buffer and the bases added here: a
  // numpy view of the rows, three numpy temporaries for the addresses and
  // pybind11's array conversion each cost tens of microseconds per pull
  // from a cold cache.
  //
  // `watch_fd` (>= 0): the peer's control connection; PeerClosed, and nothing
  // posted, if the peer has closed it (on one host a dead peer is seen only
  // there: cma would read whatever process holds its pid). `drive_for` > 0:
  // progress the batch right after posting for up to that long, under the
  // same waiter registration, so the progress thread is not woken between
  // the two. The two save a pull three calls into Python and a poll object
  // (about 40 us from a cold cache); result() then says whether it is done.
  Batch(std::shared_ptr<RemoteKey> rkey, std::shared_ptr<MemRegion> local, bool get,
        const py::buffer& rows_buffer, uint64_t remote_base, double drive_for = 0.0,
        int watch_fd = -1, bool post_on_start = false)
      : rkey_(std::move(rkey)), local_(std::move(local)) {
    const Rows rows = parse_rows(rows_buffer);
    const size_t n = rows.count;
    const uint64_t* row = rows.row;
    const uint64_t local_base = local_->address();
    // The local side is checked here; the remote runs were checked against
    // the peer's arena table before this call (the rkey alone bounds nothing
    // on cma, which reads any address of the peer).
    for (size_t i = 0; i < n; ++i) {
      const uint64_t at = row[3 * i + 1], len = row[3 * i + 2];
      if (at > UINT64_MAX - local_base || !local_->contains(local_base + at, len))
        throw py::index_error("local run " + std::to_string(i) + " is outside the local region");
      if (row[3 * i] > UINT64_MAX - remote_base)
        throw py::index_error("remote run " + std::to_string(i) + " overflows the address space");
    }
    if (watch_fd >= 0 && hung_up(watch_fd))
      throw PeerClosed("the peer closed its control connection");
    const std::shared_ptr<Endpoint>& ep = rkey_->endpoint();
    worker_obj_ = ep->worker();
    worker_ = worker_obj_->get();
    ep_ = ep->get();
    rk_ = rkey_->get();
    get_ = get;
    remote_base_ = remote_base;
    if (post_on_start) {
      // Posted by the thread that start_on() hands the batch to: posting
      // 512 GETs took this thread 0.2 ms that it can spend on its own half.
      deferred_.assign(row, row + 3 * n);
      return;
    }
    py::gil_scoped_release nogil;
    WaiterScope scope(*worker_obj_);
    post(row, n);
    if (drive_for > 0.0 && status_ == UCS_OK) drive(drive_for);
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
    return pending_.empty() && deferred_.empty();
  }

  // Waits on a thread of its own (no GIL, no executor hop) and signals the
  // returned eventfd when done, at the deadline or after abort(); an asyncio
  // loop watches the fd and then calls result().
  int start(double timeout) {
    open_event_fd();
    waiter_ = std::thread([this, timeout] {
      drive(timeout);
      signal_done();
    });
    return event_fd_;
  }

  // start() on a kept thread: the driver's (see Driver).
  int start_on(const std::shared_ptr<Driver>& driver, double timeout) {
    open_event_fd();
    driver->submit([self = shared_from_this(), timeout] {
      self->drive(timeout);
      {
        std::lock_guard<std::mutex> lock(self->done_mutex_);
        self->driven_done_ = true;
      }
      self->done_.notify_all();
      self->signal_done();
    });
    driven_ = true;  // only once submitted: join() would wait for a job never run
    return event_fd_;
  }

  // After start(): True once its thread is done (the eventfd fired), waiting
  // up to `seconds` with the GIL released. Lets a caller that expects the
  // batch to end within a few ms skip an event loop round trip.
  bool done_within(double seconds) {
    if (event_fd_ < 0) throw UcxError("the batch was not started");
    pollfd p{event_fd_, POLLIN, 0};
    py::gil_scoped_release nogil;
    return poll(&p, 1, static_cast<int>(seconds * 1000.0)) > 0;
  }

  // After start()'s fd fired: True when every operation completed.
  bool result() {
    join();
    if (status_ != UCS_OK) fail("batched transfer", status_);
    return pending_.empty() && deferred_.empty();  // an aborted one may never have posted
  }

  void abort() { aborted_.store(true); }
  size_t pending() const { return pending_.size() - head_; }

  // After a forced close of the endpoint every request has completed (with an
  // error); reap them so none is leaked.
  void release() {
    aborted_.store(true);
    join();
    if (pending_.empty() || worker_ == nullptr) return;
    for (size_t i = head_; i < pending_.size(); ++i) {
      if (ucp_request_check_status(pending_[i]) != UCS_INPROGRESS) ucp_request_free(pending_[i]);
      // A request still in progress here belongs to an endpoint that was not
      // closed; the worker reclaims it when it is destroyed.
    }
    pending_.clear();
    head_ = 0;
  }

 private:
  // The eventfd start() and start_on() return; a batch is started once.
  void open_event_fd() {
    if (waiter_.joinable() || event_fd_ >= 0) throw UcxError("the batch was already started");
    event_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (event_fd_ < 0) throw UcxError(std::string("eventfd: ") + std::strerror(errno));
  }
  // Fires the eventfd: the thread that drove the batch is done with it.
  void signal_done() {
    const uint64_t one = 1;
    [[maybe_unused]] ssize_t n = write(event_fd_, &one, sizeof(one));
  }

  // One GET or PUT per row, on the endpoint; GIL released, as a waiter.
  void post(const uint64_t* row, size_t n) {
    const uint64_t local_base = local_->address();
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_MEMH;
    param.memh = local_->get();
    if (local_->memory_type() != UCS_MEMORY_TYPE_UNKNOWN) {
      param.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMORY_TYPE;
      param.memory_type = local_->memory_type();
    }
    pending_.reserve(n + 1);
    for (size_t i = 0; i < n && status_ == UCS_OK; ++i) {
      void* buf = reinterpret_cast<void*>(local_base + row[3 * i + 1]);
      const uint64_t remote = remote_base_ + row[3 * i], len = row[3 * i + 2];
      ucs_status_ptr_t req = get_ ? ucp_get_nbx(ep_, buf, len, remote, rk_, &param)
                                  : ucp_put_nbx(ep_, buf, len, remote, rk_, &param);
      track(req);
    }
    if (!get_ && status_ == UCS_OK) {
      // A PUT completes locally first; the flush completes when the data has
      // reached the peer's memory.
      ucp_request_param_t flush_param{};
      track(ucp_ep_flush_nbx(ep_, &flush_param));
    }
  }

  // Posts the deferred rows if any (not once aborted), then progresses
  // until done, the deadline or abort().
  void drive(double timeout) {
    WaiterScope scope(*worker_obj_);
    if (!deferred_.empty() && !aborted_.load()) {
      post(deferred_.data(), deferred_.size() / 3);
      deferred_.clear();
    }
    const auto deadline = deadline_after(timeout);
    Backoff backoff;
    while (!pending_.empty() && !aborted_.load()) {
      const unsigned events = ucp_worker_progress(worker_);
      reap();
      if (pending_.empty() || Clock::now() >= deadline) break;
      events > 0 ? backoff.reset() : backoff.pause();
    }
  }
  // Called with the GIL held, except from ~Batch on the driver's thread,
  // which runs only after the driver is done with the batch.
  void join() {
    if (waiter_.joinable()) {
      py::gil_scoped_release nogil;
      waiter_.join();
    }
    if (!driven_) return;
    std::unique_lock<std::mutex> lock(done_mutex_);
    if (driven_done_) return;
    lock.unlock();
    py::gil_scoped_release nogil;
    lock.lock();
    done_.wait(lock, [this] { return driven_done_; });
  }
  void track(ucs_status_ptr_t req) {
    if (req == nullptr) return;  // completed in place
    if (UCS_PTR_IS_ERR(req)) {
      status_ = UCS_PTR_STATUS(req);
      return;
    }
    pending_.push_back(req);
  }
  // Frees completed requests from the front. cma GETs are deferred to
  // progress and complete about in post order; a scan of every pending
  // request after each progress call made a 512-run batch O(n^2) in
  // ucp_request_check_status. One finished behind an unfinished one is
  // freed once the front reaches it.
  void reap() {
    while (head_ < pending_.size()) {
      void* req = pending_[head_];
      const ucs_status_t s = ucp_request_check_status(req);
      if (s == UCS_INPROGRESS) return;
      if (s != UCS_OK && status_ == UCS_OK) status_ = s;
      ucp_request_free(req);
      ++head_;
    }
    pending_.clear();
    head_ = 0;
  }

  std::shared_ptr<RemoteKey> rkey_;
  std::shared_ptr<MemRegion> local_;
  std::shared_ptr<Worker> worker_obj_;
  ucp_worker_h worker_ = nullptr;
  ucp_ep_h ep_ = nullptr;
  ucp_rkey_h rk_ = nullptr;
  bool get_ = true;
  uint64_t remote_base_ = 0;
  std::vector<uint64_t> deferred_;  // rows start_on()'s thread posts
  std::vector<void*> pending_;  // [head_, end) are not freed yet
  size_t head_ = 0;
  ucs_status_t status_ = UCS_OK;
  std::atomic<bool> aborted_{false};
  std::thread waiter_;
  bool driven_ = false;  // started on a Driver
  bool driven_done_ = false;
  std::mutex done_mutex_;
  std::condition_variable done_;
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
  auto ucx_error = py::register_exception<UcxError>(m, "UcxError", PyExc_RuntimeError);
  // Registered after UcxError, so its translator is tried first.
  py::register_exception<PeerClosed>(m, "PeerClosed", ucx_error.ptr());
  m.def("version", &version, "version of the libucp loaded at run time");
  m.def("split_rows", &split_rows, py::arg("rows"), py::arg("min_bytes"), py::arg("read") = true,
        "two halves of a plan's rows for two workers, or None (under min_bytes, or no split "
        "that leaves a byte both write with one value)");

  py::class_<Context, std::shared_ptr<Context>>(m, "Context")
      .def(py::init<const std::map<std::string, std::string>&>(), py::arg("defaults"),
           "ucp_init with the RMA feature; UCX_* variables configure it, `defaults` "
           "(names without UCX_) what they leave unset")
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
  py::class_<Driver, std::shared_ptr<Driver>>(m, "Driver")
      .def(py::init<>())
      .def("stop", &Driver::stop, py::call_guard<py::gil_scoped_release>());
  py::class_<Batch, std::shared_ptr<Batch>>(m, "Batch")
      .def(py::init<std::shared_ptr<RemoteKey>, std::shared_ptr<MemRegion>, bool, const py::buffer&,
                    uint64_t, double, int, bool>(),
           py::arg("rkey"), py::arg("local"), py::arg("get"), py::arg("rows"),
           py::arg("remote_base"), py::arg("drive_for") = 0.0, py::arg("watch_fd") = -1,
           py::arg("post_on_start") = false,
           "post one GET (get=True) or PUT per (remote offset, local offset, length) row; "
           "PeerClosed if watch_fd's peer hung up; then progress up to drive_for seconds "
           "(post_on_start: checked now, posted by start_on()'s thread)")
      .def("wait", &Batch::wait, py::arg("timeout"))
      .def("start", &Batch::start, py::arg("timeout"),
           "wait on a thread of the batch's own; returns an eventfd that fires when done")
      .def("start_on", &Batch::start_on, py::arg("driver"), py::arg("timeout"),
           "start() on the driver's kept thread; returns the eventfd")
      .def("done_within", &Batch::done_within, py::arg("seconds"),
           "after start(): whether its thread ends within `seconds` (GIL released)")
      .def("result", &Batch::result)
      .def("abort", &Batch::abort)
      .def("release", &Batch::release)
      .def_property_readonly("pending", &Batch::pending);
}
