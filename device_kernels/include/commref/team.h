// commref/team.h — teams as values (NCCL's ncclTeam): a set of world ranks that holds
// the calling rank, as (nRanks, rank, stride). Pure functions, the same on host and
// device; DeviceComm (device.h) makes the communicator's teams and checks the ranks
// users give them.
//
// Contract:
//   - Team{nRanks, rank, stride} is relative to the rank that holds it: its members are
//     the world ranks me + (i - rank) * stride for i in [0, nRanks), where `me` is that
//     rank's world rank; `rank` is its own index in the team. A team is valid when
//     nRanks >= 1, 0 <= rank < nRanks and stride >= 1.
//   - world: (nranks, rank, 1). LSA: the ranks that load and store each other's windows,
//     (lsaSize, lsaRank, 1); rail: the ranks with the same local index on every node,
//     (nranks / lsaSize, rank / lsaSize, lsaSize). Both exist as teams only where every
//     node holds lsaSize consecutive ranks (DeviceComm::lsaTeam / railTeam refuse
//     otherwise).
//   - teamInnerFactor(parent, inner): the `inner` consecutive members of `parent` that
//     hold the caller; teamOuterFactor(parent, inner): one member of each such group, at
//     the caller's position. lsa = teamInnerFactor(world, lsaSize) and rail =
//     teamOuterFactor(world, lsaSize). `inner` must divide parent.nRanks (checked by
//     DeviceComm's versions; here the caller's duty).
//   - teamRankToWorld(me, t, i): the world rank of team rank i. teamRankIsMember(a, b, i):
//     whether b's rank i is a member of a; teamRankToTeam(a, b, i): its rank in a (-1 when
//     it is not a member). a and b are teams of the same rank.
#pragma once
#include "port.h"

namespace commref {

struct Team {
  int nRanks, rank, stride;
};

COMMREF_HD inline bool teamValid(Team t) { return t.nRanks >= 1 && t.rank >= 0 && t.rank < t.nRanks && t.stride >= 1; }
COMMREF_HD inline int teamRankToWorld(int me, Team t, int i) { return me + (i - t.rank) * t.stride; }
COMMREF_HD inline int teamRankToTeam(Team a, Team b, int i) {
  const int delta = (i - b.rank) * b.stride;  // world ranks from the caller
  if (delta % a.stride != 0) return -1;
  const int j = a.rank + delta / a.stride;
  return j >= 0 && j < a.nRanks ? j : -1;
}
COMMREF_HD inline bool teamRankIsMember(Team a, Team b, int i) { return teamRankToTeam(a, b, i) >= 0; }
COMMREF_HD inline Team teamInnerFactor(Team parent, int inner) {
  return Team{inner, parent.rank % inner, parent.stride};
}
COMMREF_HD inline Team teamOuterFactor(Team parent, int inner) {
  return Team{parent.nRanks / inner, parent.rank / inner, parent.stride * inner};
}

}  // namespace commref
