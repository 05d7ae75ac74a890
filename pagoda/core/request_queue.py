"""Waiting-queue policies of the scheduler: first-come-first-served and priority.

Both sit behind one small interface (`RequestQueue`) so the scheduler never asks
which policy is in force, except to pick a preemption victim. Iteration is always
in service order: the request `peek()` returns comes first.

Priority follows vLLM: a LOWER `priority` value is served first; ties go to the
earlier `arrival_time`, then to the request added first.
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterable, Iterator

from pagoda.core.request import Request

POLICIES = ("fcfs", "priority")


class RequestQueue(ABC):
    """A queue of requests waiting to be scheduled."""

    @abstractmethod
    def add(self, request: Request) -> None:
        """Queues a new request behind the others of its rank."""

    @abstractmethod
    def peek(self) -> Request:
        """The request to serve next (IndexError when empty)."""

    @abstractmethod
    def pop(self) -> Request:
        """Removes and returns the request to serve next (IndexError when empty)."""

    @abstractmethod
    def prepend(self, request: Request) -> None:
        """Puts back a request that was already ahead of the queue (a preempted or
        skipped one) so it is served before the requests that came after it."""

    def prepend_many(self, requests: Iterable[Request]) -> None:
        """Puts back requests, given in service order, ahead of the queue."""
        for request in reversed(list(requests)):
            self.prepend(request)

    @abstractmethod
    def remove(self, request: Request) -> None:
        """Removes one request (ValueError if it is not queued)."""

    @abstractmethod
    def remove_many(self, requests: Iterable[Request]) -> None:
        """Removes every given request that is queued; others are ignored."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[Request]:
        """The queued requests in service order."""

    def __bool__(self) -> bool:
        return len(self) > 0


class FCFSRequestQueue(RequestQueue):
    """Arrival order; preempted requests go back to the front."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def peek(self) -> Request:
        if not self._queue:
            raise IndexError("peek from an empty request queue")
        return self._queue[0]

    def pop(self) -> Request:
        if not self._queue:
            raise IndexError("pop from an empty request queue")
        return self._queue.popleft()

    def prepend(self, request: Request) -> None:
        self._queue.appendleft(request)

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def remove_many(self, requests: Iterable[Request]) -> None:
        doomed = {id(r) for r in requests}
        if doomed:
            self._queue = deque(r for r in self._queue if id(r) not in doomed)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(list(self._queue))


class PriorityRequestQueue(RequestQueue):
    """A heap keyed by (priority, arrival_time, insertion number).

    A preempted request keeps its priority and arrival time, so it lands ahead of
    everything that arrived after it; among equal (priority, arrival_time) a put-back
    request takes a negative insertion number and so goes first, as in FCFS.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._back_counter = itertools.count()
        self._front_counter = itertools.count(-1, -1)

    def _push(self, request: Request, insertion_number: int) -> None:
        heapq.heappush(
            self._heap, (request.priority, request.arrival_time, insertion_number, request)
        )

    def add(self, request: Request) -> None:
        self._push(request, next(self._back_counter))

    def peek(self) -> Request:
        if not self._heap:
            raise IndexError("peek from an empty request queue")
        return self._heap[0][3]

    def pop(self) -> Request:
        if not self._heap:
            raise IndexError("pop from an empty request queue")
        return heapq.heappop(self._heap)[3]

    def prepend(self, request: Request) -> None:
        self._push(request, next(self._front_counter))

    def remove(self, request: Request) -> None:
        for index, entry in enumerate(self._heap):
            if entry[3] is request:
                self._heap[index] = self._heap[-1]
                self._heap.pop()
                heapq.heapify(self._heap)
                return
        raise ValueError(f"{request!r} is not in the queue")

    def remove_many(self, requests: Iterable[Request]) -> None:
        doomed = {id(r) for r in requests}
        if doomed:
            self._heap = [entry for entry in self._heap if id(entry[3]) not in doomed]
            heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        # Entries never compare equal (unique insertion number), so Requests are never compared.
        return iter([entry[3] for entry in sorted(self._heap)])


def create_request_queue(policy: str) -> RequestQueue:
    """The waiting queue for a scheduling policy: "fcfs" or "priority"."""
    if policy == "fcfs":
        return FCFSRequestQueue()
    if policy == "priority":
        return PriorityRequestQueue()
    raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
