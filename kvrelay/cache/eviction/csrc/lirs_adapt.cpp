// What the compiled prefix-LIRS policy learns while it runs: each page's
// reuse intervals, when a LIR page is finished, and where the split between
// LIR and HIR pages lies. Each function is the reference's method of the same
// name in kvrelay/cache/eviction/lirs_adapt.py, which says why.
#include <algorithm>

#include "lirs_state.h"

namespace kvrelay::eviction {

void LirsState::stamp(int32_t i) {
  Node& node = nodes_[i];
  if (node.last >= 0) {
    if (node.last == now_) return;  // twice in one tick: one use
    if (node.gap) node.gap2 = node.gap;
    node.gap = now_ - node.last;
  }
  node.last = now_;
}

// Marks S's `share_band` oldest upper entries that are LIR (BAND_LIR) and Q's
// `share_band` next victims (BAND_Q): its front from the last page in (a
// stack), then the queue. The reference's `_balance` counts a batch's reads
// of these; touch_many does, in its one pass over the keys.
int LirsState::mark_bands(int32_t* marked) {
  const long band = params_.share_band;
  int n = 0;
  if (lirs_) {
    if (nodes_[top_.head].code != LIR) split();
    long seen = 0;
    for (int32_t i = top_.head; i != NIL && seen < band; i = nodes_[i].s_link.next, ++seen) {
      if (nodes_[i].code == LIR) {
        nodes_[i].band = BAND_LIR;
        marked[n++] = i;
      }
    }
  }
  long in_q = 0;
  for (int32_t i = front_.tail; i != NIL && in_q < band; i = nodes_[i].q_link.prev, ++in_q) {
    nodes_[i].band = BAND_Q;
    marked[n++] = i;
  }
  for (int32_t i = queue_.head; i != NIL && in_q < band; i = nodes_[i].q_link.next, ++in_q) {
    nodes_[i].band = BAND_Q;
    marked[n++] = i;
  }
  return n;
}

void LirsState::move_split(Py_ssize_t pages) {
  double share = hir_now_ + static_cast<double>(pages) /
                                static_cast<double>(std::max<Py_ssize_t>(n_resident_, 1));
  hir_now_ = std::min(params_.share_high, std::max(params_.share_low, share));
  lir_share_ = 1 - hir_now_;
}

void LirsState::expire() {
  while (lirs_) {
    if (nodes_[top_.head].code != LIR) split();
    int32_t i = top_.head;
    const Node& node = nodes_[i];
    if (node.last != finished_read_) {
      if (!node.gap2) return;
      double limit = params_.stale_factor * static_cast<double>(std::max(node.gap2, node.gap));
      if (static_cast<double>(now_ - node.last) <= limit) return;
      finished_read_ = node.last;
    }
    s_remove(i);
    --lirs_;
    if (!nodes_[i].held) q_push(i, nodes_[i].children ? Q_PARKED : Q_FRONT);
    prune();
  }
}

}  // namespace kvrelay::eviction
