// Python entry points of kvrelay._C: argument validation, translation of
// tensors into PageCopyParams, and dispatch to the CPU or CUDA copy.
//
// Every argument is checked before a byte moves: a bad call raises a Python
// TypeError / ValueError / IndexError, never a crash or a write outside a
// tensor. Errors name the argument and what was expected.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <string>
#include <vector>

#include "page_copy.h"

#ifdef KVRELAY_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace kvrelay {
namespace {

constexpr int64_t kBytesPerThread = 4 << 20;
constexpr int64_t kStreamingBytes = 1 << 20;

struct PoolGeometry {
  int64_t num_slots = 0;
  int64_t num_heads = 0;
  int64_t slot_stride = 0;  // bytes
  int64_t head_stride = 0;  // bytes
  int64_t row_bytes = 0;
};

// All layers of one tensor kind (K or V) must share dtype, device, shape and
// strides: one PoolGeometry then describes every layer.
PoolGeometry check_layers(const std::vector<at::Tensor>& layers, const char* name,
                          const at::Tensor& like) {
  PoolGeometry g;
  for (size_t l = 0; l < layers.size(); ++l) {
    const at::Tensor& t = layers[l];
    TORCH_CHECK_VALUE(t.defined(), name, "[", l, "] is undefined");
    TORCH_CHECK_VALUE(t.dim() == 3, name, "[", l,
                      "] must be [num_slots, heads, head_dim], got ", t.dim(), " dims");
    TORCH_CHECK_TYPE(t.scalar_type() == like.scalar_type(), name, "[", l, "] has dtype ",
                     t.scalar_type(), ", expected ", like.scalar_type(),
                     " (all K and V layers share one KV dtype)");
    TORCH_CHECK_VALUE(t.device() == like.device(), name, "[", l, "] is on ", t.device(),
                      ", expected ", like.device());
    TORCH_CHECK_VALUE(t.size(2) == 0 || t.stride(2) == 1, name, "[", l,
                      "] must be contiguous in head_dim (stride 1), got stride ", t.stride(2));
    TORCH_CHECK_VALUE(t.stride(0) >= 0 && t.stride(1) >= 0, name, "[", l,
                      "] has negative strides");
    const int64_t es = t.element_size();
    if (l == 0) {
      g = {t.size(0), t.size(1), t.stride(0) * es, t.stride(1) * es, t.size(2) * es};
    } else {
      TORCH_CHECK_VALUE(t.size(0) == g.num_slots && t.size(1) == g.num_heads &&
                            t.size(2) * es == g.row_bytes && t.stride(0) * es == g.slot_stride &&
                            t.stride(1) * es == g.head_stride,
                        name, "[", l, "] has shape ", t.sizes(), " / strides ", t.strides(),
                        " unlike ", name, "[0]");
    }
  }
  return g;
}

struct CopyCall {
  PageCopyParams base{};
  std::vector<uint8_t*> k_ptrs, v_ptrs;
  at::Device device{at::kCPU};
};

CopyCall prepare(const std::vector<at::Tensor>& k_layers, const std::vector<at::Tensor>& v_layers,
                 const at::Tensor& pages, const at::Tensor& page_ids,
                 const at::Tensor& slot_mapping, int64_t page_heads, int64_t page_layers,
                 int64_t page_head_start, int64_t page_layer_start, int64_t pool_head_start,
                 int64_t num_heads, bool gather) {
  TORCH_CHECK_VALUE(!k_layers.empty(), "k_layers is empty: pass one K tensor per layer");
  const at::Tensor& first = k_layers[0];
  TORCH_CHECK_VALUE(first.defined(), "k_layers[0] is undefined");
  const PoolGeometry k = check_layers(k_layers, "k_layers", first);
  PoolGeometry v;
  if (!v_layers.empty()) {
    TORCH_CHECK_VALUE(v_layers.size() == k_layers.size(), "v_layers has ", v_layers.size(),
                      " layers but k_layers has ", k_layers.size(), " (pass [] for MLA)");
    v = check_layers(v_layers, "v_layers", first);
    TORCH_CHECK_VALUE(v.num_slots == k.num_slots && v.num_heads == k.num_heads,
                      "v_layers are [", v.num_slots, ", ", v.num_heads, ", *] but k_layers are [",
                      k.num_slots, ", ", k.num_heads, ", *]");
  }
  const at::Device device = first.device();

  TORCH_CHECK_TYPE(pages.scalar_type() == at::kByte, "pages must be uint8 (page objects are bytes), got ",
                   pages.scalar_type());
  TORCH_CHECK_VALUE(pages.dim() == 2, "pages must be [num_arena_pages, page_bytes], got ",
                    pages.dim(), " dims");
  TORCH_CHECK_VALUE(pages.device() == device, "pages is on ", pages.device(), ", pool on ", device);
  TORCH_CHECK_VALUE(pages.size(1) == 0 || pages.stride(1) == 1,
                    "pages rows must be contiguous (stride 1 in dim 1)");
  TORCH_CHECK_TYPE(page_ids.scalar_type() == at::kLong, "page_ids must be int64, got ",
                   page_ids.scalar_type());
  TORCH_CHECK_TYPE(slot_mapping.scalar_type() == at::kLong, "slot_mapping must be int64, got ",
                   slot_mapping.scalar_type());
  TORCH_CHECK_VALUE(page_ids.dim() == 1 && page_ids.is_contiguous(),
                    "page_ids must be a contiguous 1-D tensor");
  TORCH_CHECK_VALUE(slot_mapping.dim() == 2 && slot_mapping.is_contiguous(),
                    "slot_mapping must be a contiguous [num_pages, page_size] tensor");
  TORCH_CHECK_VALUE(page_ids.device() == device && slot_mapping.device() == device,
                    "page_ids and slot_mapping must be on the pool's device ", device);
  const int64_t num_pages = page_ids.size(0);
  const int64_t page_size = slot_mapping.size(1);
  TORCH_CHECK_VALUE(slot_mapping.size(0) == num_pages, "slot_mapping has ", slot_mapping.size(0),
                    " pages but page_ids has ", num_pages);
  TORCH_CHECK_VALUE(page_size > 0, "page_size (slot_mapping.size(1)) must be positive");

  TORCH_CHECK_VALUE(page_heads > 0 && page_layers > 0, "page_heads and page_layers must be positive");
  TORCH_CHECK_VALUE(num_heads > 0, "num_heads must be positive");
  TORCH_CHECK_INDEX(page_head_start >= 0 && page_head_start + num_heads <= page_heads,
                    "heads [", page_head_start, ", ", page_head_start + num_heads,
                    ") outside a page object of ", page_heads, " heads");
  const int64_t layers = static_cast<int64_t>(k_layers.size());
  TORCH_CHECK_INDEX(page_layer_start >= 0 && page_layer_start + layers <= page_layers,
                    "layers [", page_layer_start, ", ", page_layer_start + layers,
                    ") outside a page object of ", page_layers, " layers");
  TORCH_CHECK_INDEX(pool_head_start >= 0 && pool_head_start + num_heads <= k.num_heads,
                    "pool heads [", pool_head_start, ", ", pool_head_start + num_heads,
                    ") outside a pool of ", k.num_heads, " heads");
  const int64_t page_bytes = page_heads * page_layers * page_size * (k.row_bytes + v.row_bytes);
  TORCH_CHECK_VALUE(pages.size(1) == page_bytes, "pages rows are ", pages.size(1),
                    " bytes but a page object of ", page_heads, " heads x ", page_layers,
                    " layers x ", page_size, " tokens x ", k.row_bytes + v.row_bytes,
                    " bytes/token is ", page_bytes);

  if (num_pages > 0) {
    const auto [id_min, id_max] = at::aminmax(page_ids);
    TORCH_CHECK_INDEX(id_min.item<int64_t>() >= 0 && id_max.item<int64_t>() < pages.size(0),
                      "page_ids must lie in [0, ", pages.size(0), ")");
    const auto [slot_min, slot_max] = at::aminmax(slot_mapping);
    TORCH_CHECK_INDEX(slot_min.item<int64_t>() >= -1 && slot_max.item<int64_t>() < k.num_slots,
                      "slot_mapping values must lie in [-1, ", k.num_slots, ")");
    // Two writers of one destination would race: distinct pages for gather,
    // distinct slots for scatter.
    if (gather) {
      TORCH_CHECK_VALUE(std::get<0>(at::_unique(page_ids)).numel() == num_pages,
                        "page_ids has duplicates: two pages would be written to one arena row");
    } else {
      const at::Tensor valid = slot_mapping.masked_select(slot_mapping.ge(0));
      TORCH_CHECK_VALUE(std::get<0>(at::_unique(valid)).numel() == valid.numel(),
                        "slot_mapping has duplicate slots: two tokens would be written to one slot");
    }
  }

  CopyCall call;
  call.device = device;
  PageCopyParams& p = call.base;
  p.k_slot_stride = k.slot_stride;
  p.k_head_stride = k.head_stride;
  p.v_slot_stride = v.slot_stride;
  p.v_head_stride = v.head_stride;
  p.k_row_bytes = k.row_bytes;
  p.v_row_bytes = v.row_bytes;
  p.pool_head_start = pool_head_start;
  p.num_pages = num_pages;
  p.page_size = page_size;
  p.page_ids = page_ids.data_ptr<int64_t>();
  p.slot_mapping = slot_mapping.data_ptr<int64_t>();
  p.pages = static_cast<uint8_t*>(pages.data_ptr());
  p.page_stride = pages.stride(0);
  p.page_heads = page_heads;
  p.page_layers = page_layers;
  p.page_head_start = page_head_start;
  p.page_layer_start = page_layer_start;
  p.num_heads = num_heads;
  // CPU heuristics. A thread per ~4 MiB moved (up to torch's intra-op thread
  // count): a copy starts its threads afresh, and below that (a 4 MiB copy
  // takes ~0.14 ms) starting one costs more than it saves, more so beside a
  // busy process on few cores. Streaming stores from 1 MiB: a destination
  // that size is rarely read back soon from this core's caches (pages go to
  // another process or a NIC; a pool's pages to the device), and the stores
  // skip its read-for-ownership (4 MiB gathered into a cache server's slots,
  // not in cache: 0.53 -> 0.19 ms here).
  const int64_t bytes = num_pages * num_heads * layers * page_size * (k.row_bytes + v.row_bytes);
  p.cpu_threads = std::clamp<int64_t>(bytes / kBytesPerThread, 1, at::get_num_threads());
  p.streaming_stores = bytes >= kStreamingBytes;
  for (const auto& t : k_layers) call.k_ptrs.push_back(static_cast<uint8_t*>(t.data_ptr()));
  for (const auto& t : v_layers) call.v_ptrs.push_back(static_cast<uint8_t*>(t.data_ptr()));
  return call;
}

// Runs the copy in chunks of kMaxLayersPerLaunch layers, the GIL released.
void run(CopyCall& call, bool gather) {
  const int64_t layers = static_cast<int64_t>(call.k_ptrs.size());
  const int64_t first_layer = call.base.page_layer_start;
#ifdef KVRELAY_WITH_CUDA
  std::optional<c10::cuda::CUDAGuard> guard;
  if (call.device.is_cuda()) guard.emplace(call.device);
#else
  TORCH_CHECK_VALUE(call.device.is_cpu(), "kvrelay._C was built without CUDA; tensors are on ",
                    call.device);
#endif
  pybind11::gil_scoped_release no_gil;
  for (int64_t start = 0; start < layers; start += kMaxLayersPerLaunch) {
    PageCopyParams p = call.base;
    p.num_layers = std::min<int64_t>(kMaxLayersPerLaunch, layers - start);
    p.page_layer_start = first_layer + start;
    for (int64_t l = 0; l < p.num_layers; ++l) {
      p.k_layers[l] = call.k_ptrs[start + l];
      p.v_layers[l] = call.v_ptrs.empty() ? nullptr : call.v_ptrs[start + l];
    }
#ifdef KVRELAY_WITH_CUDA
    if (call.device.is_cuda()) {
      void* stream = c10::cuda::getCurrentCUDAStream(call.device.index()).stream();
      gather ? gather_pages_cuda(p, stream) : scatter_pages_cuda(p, stream);
      continue;
    }
#endif
    gather ? gather_pages_cpu(p) : scatter_pages_cpu(p);
  }
}

template <bool kGather>
void copy_entry(const std::vector<at::Tensor>& k_layers, const std::vector<at::Tensor>& v_layers,
                const at::Tensor& pages, const at::Tensor& page_ids, const at::Tensor& slot_mapping,
                int64_t page_heads, int64_t page_layers, int64_t page_head_start,
                int64_t page_layer_start, int64_t pool_head_start, int64_t num_heads) {
  CopyCall call = prepare(k_layers, v_layers, pages, page_ids, slot_mapping, page_heads,
                          page_layers, page_head_start, page_layer_start, pool_head_start,
                          num_heads, kGather);
  run(call, kGather);
}

}  // namespace
}  // namespace kvrelay

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.doc() = "kvrelay compiled ops: gather/scatter between paged KV pools and unified pages";
  auto def_copy = [&m](const char* name, auto fn, const char* doc) {
    m.def(name, fn, doc, py::arg("k_layers"), py::arg("v_layers"), py::arg("pages"),
          py::arg("page_ids"), py::arg("slot_mapping"), py::arg("page_heads"),
          py::arg("page_layers"), py::arg("page_head_start"), py::arg("page_layer_start"),
          py::arg("pool_head_start"), py::arg("num_heads"));
  };
  def_copy("gather_pages", &kvrelay::copy_entry<true>,
           "Copy the KV of each page's token slots from per-layer pool tensors into the\n"
           "rectangle (heads x layers) of unified page objects (rows of `pages`).");
  def_copy("scatter_pages", &kvrelay::copy_entry<false>,
           "Inverse of gather_pages: copy page-object rectangles into the pool.");
  m.def("cpu_page_copy_loops", &kvrelay::cpu_page_copy_loops,
        "Which build of the CPU loops runs: 'avx2' or 'baseline' (plain x86-64).");
#ifdef KVRELAY_WITH_CUDA
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
}
