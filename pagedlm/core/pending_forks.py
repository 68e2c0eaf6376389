"""Samples 2..n of a request (n > 1) that wait for the first one, their leader.

They start when the leader samples its first token, sharing its prompt blocks instead of
computing the prompt again (`Scheduler.update_from_output`). Until then they are in no
queue, only in this table: leader request id -> followers, in the order they came.
"""

from __future__ import annotations

from pagedlm.core.request import Request


class PendingForks(dict[str, list[Request]]):
    def add(self, leader_id: str, followers: list[Request]) -> None:
        self.setdefault(leader_id, []).extend(followers)

    def remove(self, follower: Request) -> None:
        """Drop a follower that ends before its leader sampled."""
        for leader_id, followers in list(self.items()):
            if follower in followers:
                followers.remove(follower)
                if not followers:
                    del self[leader_id]
                return
        raise AssertionError(f"{follower} is in no queue")

    def followers(self) -> list[Request]:
        return [f for followers in self.values() for f in followers]

    @property
    def num_followers(self) -> int:
        return sum(len(followers) for followers in self.values())
