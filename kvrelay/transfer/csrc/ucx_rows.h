// kvrelay._ucx: a pull's plan as the binding reads it, and its split into
// two halves for two workers (striped same-host pulls).
#pragma once

#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace kvrelay::ucx {
namespace {

// split_rows gives its first half a multiple of this many bytes.
constexpr uint64_t kStripeAlign = 4096;

// A plan's rows: `count` native uint64 (remote offset, local offset, length)
// triples at `row`, borrowed from the caller's buffer.
struct Rows {
  py::buffer_info info;
  const uint64_t* row;
  size_t count;
};

// The planner's bytearray, bytes, or a (k, 3) uint64 array, checked.
Rows parse_rows(const py::buffer& rows_buffer) {
  py::buffer_info info = rows_buffer.request();
  const auto bytes = static_cast<size_t>(info.size * info.itemsize);
  const bool contiguous =
      info.ndim == 1 ? info.strides[0] == info.itemsize
                     : (info.ndim == 2 && info.strides[1] == info.itemsize &&
                        info.strides[0] == info.itemsize * info.shape[1]);
  const char kind = info.format.empty() ? '?' : info.format.back();
  const bool u64_or_bytes = (info.itemsize == 8 && (kind == 'Q' || kind == 'L')) ||
                            (info.itemsize == 1 && (kind == 'B' || kind == 'b' || kind == 'c'));
  if (!contiguous || !u64_or_bytes || bytes % 24 != 0 ||
      (info.ndim == 2 && info.shape[1] * info.itemsize != 24))
    throw py::value_error(
        "rows must be a contiguous buffer of uint64 (remote, local, length) triples");
  if (reinterpret_cast<uintptr_t>(info.ptr) % alignof(uint64_t) != 0)
    throw py::value_error("rows must be 8-byte aligned");
  const auto* row = static_cast<const uint64_t*>(info.ptr);
  return Rows{std::move(info), row, bytes / 24};
}

// True when any two rows that write a common byte copy the same source byte
// to it: their destination runs (local for a pull, `dest` 1; remote for a
// push, `dest` 0) overlap only where the offset from source to destination
// is the same. Two workers may then split the rows anywhere: where both
// write a byte, both write the value the whole plan leaves there. Plans
// usually list apart destination runs in order (one pass); others are
// sorted first.
bool writes_agree(const Rows& rows, int dest) {
  uint64_t end = 0;
  size_t i = 0;
  for (; i < rows.count; ++i) {
    const uint64_t at = rows.row[3 * i + dest], len = rows.row[3 * i + 2];
    if (len == 0) continue;
    if (at < end) break;
    end = at + len;
  }
  if (i == rows.count) return true;
  struct Write {
    uint64_t start, end, shift;  // shift: destination minus source, mod 2^64
  };
  std::vector<Write> writes;
  writes.reserve(rows.count);
  for (size_t j = 0; j < rows.count; ++j) {
    const uint64_t* r = rows.row + 3 * j;
    if (r[2] > 0) writes.push_back({r[dest], r[dest] + r[2], r[1] - r[0]});
  }
  std::stable_sort(writes.begin(), writes.end(),
                   [](const Write& a, const Write& b) { return a.start < b.start; });
  // A cluster is a run of writes each overlapping what came before it; all
  // of a cluster's writes must share one shift.
  uint64_t reach = 0, shift = 0;
  for (size_t j = 0; j < writes.size(); ++j) {
    if (j > 0 && writes[j].start < reach) {
      if (writes[j].shift != shift) return false;
      reach = std::max(reach, writes[j].end);
    } else {
      reach = writes[j].end;
      shift = writes[j].shift;
    }
  }
  return true;
}

using Span = std::pair<uint64_t, uint64_t>;  // [start, end) of destination bytes

// The destination runs (column `dest`) of `v`'s (remote, local, length)
// triples, sorted and merged.
std::vector<Span> merged_writes(const std::vector<uint64_t>& v, int dest) {
  std::vector<Span> spans;
  spans.reserve(v.size() / 3);
  for (size_t i = 0; i < v.size(); i += 3)
    if (v[i + 2] > 0) spans.emplace_back(v[i + dest], v[i + dest] + v[i + 2]);
  std::sort(spans.begin(), spans.end());
  std::vector<Span> merged;
  for (const Span& s : spans) {
    if (!merged.empty() && s.first < merged.back().second)
      merged.back().second = std::max(merged.back().second, s.second);
    else
      merged.push_back(s);
  }
  return merged;
}

// Whether two sorted, merged span lists share a byte.
bool spans_meet(const std::vector<Span>& a, const std::vector<Span>& b) {
  size_t i = 0, j = 0;
  while (i < a.size() && j < b.size()) {
    if (a[i].first < b[j].second && b[j].first < a[i].second) return true;
    a[i].second <= b[j].second ? ++i : ++j;
  }
  return false;
}

// Splits `rows` in two halves of about equal bytes, the row across the
// middle cut so that the first holds a whole number of kStripeAlign.
void split_by_bytes(const Rows& rows, uint64_t total, std::vector<uint64_t>& first,
                    std::vector<uint64_t>& second) {
  const uint64_t half = total / 2 / kStripeAlign * kStripeAlign;
  uint64_t moved = 0;
  for (size_t i = 0; i < rows.count; ++i) {
    const uint64_t* r = rows.row + 3 * i;
    if (moved >= half) {
      second.insert(second.end(), r, r + 3);
    } else if (moved + r[2] <= half) {
      first.insert(first.end(), r, r + 3);
    } else {
      const uint64_t cut = half - moved;  // 0 < cut < r[2]
      first.insert(first.end(), {r[0], r[1], cut});
      second.insert(second.end(), {r[0] + cut, r[1] + cut, r[2] - cut});
    }
    moved += r[2];
  }
}

// Splits every row at its middle (a whole number of kStripeAlign first;
// rows too short to cut go first whole).
void split_by_columns(const Rows& rows, std::vector<uint64_t>& first,
                      std::vector<uint64_t>& second) {
  for (size_t i = 0; i < rows.count; ++i) {
    const uint64_t* r = rows.row + 3 * i;
    const uint64_t cut = r[2] / 2 / kStripeAlign * kStripeAlign;
    if (cut == 0) {
      first.insert(first.end(), r, r + 3);
      continue;
    }
    first.insert(first.end(), {r[0], r[1], cut});
    second.insert(second.end(), {r[0] + cut, r[1] + cut, r[2] - cut});
  }
}

// Two plans that together move exactly `rows`, for two workers to copy at
// once, such that a byte both write gets the same value from each; None
// when the plan moves under `min_bytes` or no such split was found. A plan
// whose rows agree where they overlap (`writes_agree`: always so for apart
// destination runs, and for ucx_perftest's pattern, one run read again and
// again into one place) is cut in the middle of its bytes, the first half a
// whole number of 4 KiB. One whose rows write some byte with two different
// sources has every row cut in the middle instead, the first halves to one
// worker and the second halves to the other, if that leaves the two
// workers' destination bytes apart (each byte then gets the value its last
// row gives it, as in the whole plan).
py::object split_rows(const py::buffer& rows_buffer, uint64_t min_bytes, bool read) {
  const Rows rows = parse_rows(rows_buffer);
  const int dest = read ? 1 : 0;
  uint64_t total = 0;
  for (size_t i = 0; i < rows.count; ++i) total += rows.row[3 * i + 2];
  if (total < min_bytes || total < 2 * kStripeAlign) return py::none();
  std::vector<uint64_t> first, second;
  first.reserve(3 * rows.count + 3);
  second.reserve(3 * rows.count + 3);
  if (writes_agree(rows, dest)) {
    split_by_bytes(rows, total, first, second);
  } else {
    split_by_columns(rows, first, second);
    if (second.empty() || spans_meet(merged_writes(first, dest), merged_writes(second, dest)))
      return py::none();
  }
  auto as_bytes = [](const std::vector<uint64_t>& v) {
    return py::bytearray(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(uint64_t));
  };
  return py::make_tuple(as_bytes(first), as_bytes(second));
}

}  // namespace
}  // namespace kvrelay::ucx
