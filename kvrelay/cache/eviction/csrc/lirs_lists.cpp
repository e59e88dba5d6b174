// The linked lists of the compiled prefix-LIRS policy (see lirs_state.h): S
// (top and tail), Q (front and queue), the parked pages and the resident
// order, each through one of a node's three links.
#include "lirs_state.h"

#include <utility>

namespace kvrelay::eviction {

Link& LirsState::link(int32_t i, Via via) {
  return const_cast<Link&>(std::as_const(*this).link(i, via));
}

const Link& LirsState::link(int32_t i, Via via) const {
  const Node& node = nodes_[i];
  return via == VIA_S ? node.s_link : via == VIA_Q ? node.q_link : node.r_link;
}

void LirsState::push_back(List& list, int32_t i) {
  Link& l = link(i, list.via);
  l.prev = list.tail;
  l.next = NIL;
  if (list.tail != NIL) link(list.tail, list.via).next = i;
  else list.head = i;
  list.tail = i;
  ++list.size;
}

void LirsState::unlink(List& list, int32_t i) {
  Link& l = link(i, list.via);
  if (l.prev != NIL) link(l.prev, list.via).next = l.next;
  else list.head = l.next;
  if (l.next != NIL) link(l.next, list.via).prev = l.prev;
  else list.tail = l.prev;
  l.prev = l.next = NIL;
  --list.size;
}

int32_t LirsState::pop_front(List& list) {
  int32_t i = list.head;
  unlink(list, i);
  return i;
}

int32_t LirsState::pop_back(List& list) {
  int32_t i = list.tail;
  unlink(list, i);
  return i;
}

void LirsState::s_push(int32_t i, SPart part, uint8_t code) {
  nodes_[i].s = part;
  nodes_[i].code = code;
  push_back(s_list(part), i);
}

void LirsState::s_remove(int32_t i) {
  unlink(s_list(nodes_[i].s), i);
  nodes_[i].s = S_OUT;
}

List& LirsState::q_list(uint8_t part) {
  return part == Q_FRONT ? front_ : part == Q_QUEUE ? queue_ : parked_;
}

void LirsState::q_push(int32_t i, QPart part) {
  nodes_[i].q = part;
  push_back(q_list(part), i);
}

void LirsState::q_remove(int32_t i) {
  if (nodes_[i].q == Q_OUT) return;
  unlink(q_list(nodes_[i].q), i);
  nodes_[i].q = Q_OUT;
}

}  // namespace kvrelay::eviction
