"""Restarts on several nodes (--max-restarts N with --nnodes above 1): one decision for the job,
which every node follows, and a new round of the rendezvous for each restart.

1. The end. Every node tears its workers down as on its own and settles (launcher/nodes/
   multinode.py), after posting how its attempt ended (after/end/<node>: launcher/supervise/
   restarts.py's AttemptEnd). Node 0 takes the job's first failure (the node the abort key
   names, or a lost node: `lost_node`), judges it by the one-machine rules, writes restarts.jsonl
   (every node's devices) and posts the decision; every node says it and follows it.
2. The next round. Node 0's launcher keeps hosting its store; each round's keys live under
   round<r>/ (a PrefixedStore), so they never meet an earlier round's. Node 0 opens the
   round (the bare key `round`), every node checks in (back/<node>), and node 0 waits up to
   --join-timeout for every node of the last round (Slurm may requeue a lost one; a relaunched
   launcher finds the open round by that key). A node that does not come back stops the job with
   the last failure's code, or, with --min-nnodes M, the round goes on with the nodes back (at
   least M, renumbered in order), keeping the global batch through gradient accumulation. Then
   every node joins the round as it joined the first (launcher/nodes/rendezvous.py), and node 0
   shares the run directory, the checkpoint to resume (the run's latest complete one) and the
   worker port. If node 0 is the node lost, the job stops: the rendezvous went with it. A
   launcher started again while the job runs waits for the next round (_rejoin). A renumbered
   node keeps its launch rank for its own files (NodeSpec.own_rank).
3. A stop signal to any node from 1 until the round has formed stops every node
   (launcher/nodes/between_rounds.py), and node 0 records that no restart happened; one to a node
   held just after its workers ended does so only when the decision is a restart (else that node
   ends with the signal's code, as on one machine), and one to a relaunched node while the job
   runs an attempt stops that node alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from launcher import local_tier
from launcher.exit_codes import by_signal, stop_signal
from launcher.gpus.request import DeviceError
from launcher.nodes import between_rounds, multinode
from launcher.nodes.agreement import restart_options
from launcher.nodes.between_rounds import BETWEEN_KEY, BetweenRounds, Halt, Halted, HeldOnceSpawned
from launcher.nodes.job_end import end_record, job_end, posted_ends
from launcher.nodes.key_value import StoreClient
from launcher.nodes.node import NodeSpec
from launcher.nodes.rendezvous import POLL_INTERVAL, Node, RendezvousError, connect
from launcher.nodes.round_checkin import ROUND_KEY, check_in, gather_round, open_round
from launcher.nodes.store import client, first_line
from launcher.processes.torchrun_env import Restarts
from launcher.restart_plan import Devices, RestartPlan, check_global_batch_kept, warn_without_checkpoints
from launcher.rundir import lock
from launcher.rundir.choice import own_run_dir, resume_point, run_dir_path
from launcher.rundir.lock import RunDirLock
from launcher.supervise import restarts
from launcher.supervise.printer import Printer
from launcher.supervise.restarts import AttemptEnd
from pretrain import config as cfg

Attempt = Callable[[cfg.Config, Node, Path, int, Restarts, Callable[[], None]], tuple[int, AttemptEnd]]
"""One attempt on this node (launch.py run_owned): its config, round, run directory, port, restart
count, and what to call once its workers are spawned -> its exit code and how it ended."""


def check_global_batch(args: argparse.Namespace, config: cfg.Config, command: list[str], nproc: int, nnodes: int) -> None:
    """--min-nnodes M on a training run: a global batch that every node count from M up keeps."""
    if args.min_nnodes is None or command:
        return
    check_global_batch_kept(
        config.training, nproc * nnodes, range(args.min_nnodes, nnodes), "--min-nnodes", f"node(s) of {nproc} worker(s)", nproc
    )


@dataclass
class Decision:
    """Node 0's word after an attempt, which every node follows."""

    restart: bool
    why: str
    wait: float = 0.0


@dataclass
class RestartRounds:
    """This node's part of a job of several nodes that restarts (the module's steps)."""

    args: argparse.Namespace
    config: cfg.Config
    """As given (node 0 resolves its resume on the first round)."""
    command: list[str]
    devices: Devices
    console: Printer
    spec: NodeSpec
    """This node's place in the job as launched (its rank names it in every round's check-in)."""
    attempt: Attempt
    free_port: Callable[[], int]
    hosted: Any = None
    """Node 0: the store it hosts, from the first round to the last."""
    roster: list[int] = field(default_factory=list)
    """The nodes (their launch ranks) of the current round, in their order."""
    owned: RunDirLock | None = None
    first_config: cfg.Config | None = None
    """Node 0: the first attempt's config, its resume resolved (restarts start from it)."""
    first_nproc: int = 0
    """This node's workers in the first attempt (every restart asks for as many)."""
    first_world: int = 0
    """The job's workers in the first attempt (its global batch is kept)."""
    record: restarts.Record | None = None
    pending: tuple[restarts.Attempt, restarts.Verdict] | None = None
    """Node 0: the attempt whose restart was decided, recorded as made once the next attempt begins."""
    started: bool = False
    between: int | None = None
    """The round this node's stretch between attempts comes before (None: a relaunched node's wait)."""

    @property
    def say(self) -> Callable[[str], None]:
        return self.console.launcher_line

    @property
    def training(self) -> bool:
        return not self.command

    def run(self) -> int:
        """Every attempt of the job on this node; the exit code of its last."""
        nproc = self.devices.placement.world_size
        check_global_batch(self.args, self.config, self.command, nproc, self.spec.nnodes)
        self.first_nproc, self.first_world = nproc, nproc * self.spec.nnodes
        try:
            code = self._attempts()
        except BaseException:
            if self.owned is not None and not self.started:
                self.owned.abandon()
            raise
        if self.owned is not None:
            self.owned.release()
        return code

    def _attempts(self) -> int:
        number = 0
        previous: AttemptEnd | None = None
        try:
            node = self._rejoin() if not self.spec.is_master else None
        except Halted as halted:  # relaunched, and stopped before it rejoined the job
            return self._halted(halted, None, None, None)
        if node is None:
            node = self._join(self.spec, "")
        with multinode.telling_others(node):
            config, port, number = self._plan(node, number)
        while True:
            begun: list[restarts.Attempt | None] = []  # its line of the record, once its workers are spawned
            held: list[int] = []  # a stop signal once the supervisor has given the signals back
            hold, entry, job = HeldOnceSpawned(begun, held), None, None
            try:
                with hold:
                    with multinode.telling_others(node):
                        self.started = True
                        spawned = functools.partial(self._begin, config, begun)
                        try:
                            restart = Restarts(number, self.args.max_restarts)
                            code, end = self.attempt(config, node, self.owned_path, port, restart, spawned)
                            if not begun:  # workers that could not all start: the attempt is recorded all the same
                                spawned()
                            self._post(node, f"end/{node.rank}", end_record(end))
                        except BaseException as error:
                            if not begun:  # ended while it prepared: a restart decided before it did not happen
                                self._not_begun(error)
                            raise
                    entry, self.between = begun[0], number + 1
                    # A stop signal to any node stops every node (BetweenRounds takes the signals from hold).
                    with hold.hand_over(BetweenRounds(self._client, self.spec.node_rank, self.between)):
                        if self.hosted is not None:
                            self.hosted.set(BETWEEN_KEY, str(self.between))  # a relaunched node's word (_rejoin)
                        if held and code != 0:  # after a failure, at once: node 0 may still tear its workers down
                            raise Halted(Halt(self.spec.node_rank, held[0]), here=True)
                        self._signalled_in_teardown(node, end)
                        wait = self.args.stop_timeout + self.args.kill_grace + self.args.node_timeout
                        code = multinode.settle(node, code, wait, self.say)
                        decision, job = self._decide(node, number, previous, entry, code)
                        if held and decision.restart:  # held after workers that succeeded here: the restart is stopped
                            raise Halted(Halt(self.spec.node_rank, held[0]), here=True)
                        next_node = self._restart(decision, number) if decision.restart else None
            except Halted as halted:
                return self._halted(halted, node, entry, job)
            if not decision.restart:
                if code != 0:
                    self.say(f"not restarted: {decision.why}")
                if number > 0 and self.record is not None:
                    self.say("\n".join(self.record.summary()))
                return self._held_at_end(held, code)
            if next_node is None:  # the last failure stands
                self._stopped_between(entry, job)
                return code
            previous, node = job, next_node
            try:
                with multinode.telling_others(node):
                    config, port, number = self._plan(node, number + 1)
            except BaseException as error:  # the others hear a stop as the round's interrupt
                self._not_begun(error)
                raise

    def _restart(self, decision: Decision, number: int) -> Node | None:
        """Restart `number + 1`: the backoff, the devices again, the next round; None when the job stops."""
        self.say(f"restart {number + 1} of {self.args.max_restarts} in {decision.wait:g} s: {decision.why}")
        try:
            end = time.monotonic() + decision.wait
            while (left := end - time.monotonic()) > 0:  # in steps: another node's stop is handed over between them
                time.sleep(min(left, POLL_INTERVAL))
            self.devices.placement.release()
            self.devices.placement = self._restart_plan().place_again(self.devices, self.first_nproc)
            return self._next_round(number + 1)
        except (DeviceError, RendezvousError) as error:
            self.say(f"no restart: {error}")
            return None

    def _held_at_end(self, held: list[int], code: int) -> int:
        """The job ends, no restart due: a stop signal held just after this node's workers ended
        changes nothing for the others; this node ends with its code, as one machine does."""
        if not held:
            return code
        halt = Halt(self.spec.node_rank, held[0])
        self.say(f"received {halt.name} after this node's workers had ended; exit code {by_signal(halt.signum)}")
        return by_signal(halt.signum)

    def _signalled_in_teardown(self, node: Node, end: AttemptEnd) -> None:
        """A stop signal to any node while the failed attempt's workers were torn down (the
        supervisor said it in the round's interrupt key, and cut the teardown short): Halted."""
        if not end.stopped and (asked := node.interrupted()) is not None:
            launched = self.roster[asked.node] if asked.node < len(self.roster) else asked.node
            raise Halted(Halt(launched, asked.signum), here=asked.node == node.rank)

    def _client(self) -> Any:
        """A connection of its own to node 0's store (node 0's too), for a stop between attempts."""
        return client(self.spec, self.args.node_timeout)

    def _halted(self, halted: Halted, node: Node | None, entry: restarts.Attempt | None, job: AttemptEnd | None) -> int:
        """A stop signal between attempts, here or on another node: every node stops with its code;
        node 0 records that the restart did not happen (launcher/nodes/between_rounds.py)."""
        seconds = self.args.node_timeout
        number = halted.number or self.between or between_rounds.stretch_of(self._client, seconds)
        if number is None:  # a relaunched node, while the job runs an attempt: nothing to stop but this node
            self.say(halted.halt.alone())
            return by_signal(halted.halt.signum)
        # Also a halt read from the round's interrupt key: the nodes that wait on node 0's decision hear it.
        first = between_rounds.tell(self._client, halted.halt, number, seconds)
        if halted.here and node is not None:  # a node still tearing its workers down kills them now (its supervisor)
            node.report_interrupt(halted.halt.signum)
        self.say(halted.halt.line(halted.here))
        if not self.spec.is_master:
            between_rounds.acknowledge(self._client, number, self.spec.node_rank, seconds)
            return by_signal(halted.halt.signum)
        if self.record is not None and entry is not None:
            if job is None:  # stopped before node 0 had judged the attempt
                assert node is not None  # node 0 joined before any attempt
                job = job_end(node, posted_ends(node, seconds))
            if warning := self.record.end(entry, job, restarts.Verdict(False, first.why())):
                self.say(warning)
            self.say("\n".join(self.record.summary()))
        readers = [n for n in self.roster if n != self.spec.node_rank]
        between_rounds.wait_for_readers(self.hosted, number, readers, seconds)
        return by_signal(halted.halt.signum)

    def _not_begun(self, error: BaseException) -> None:
        """Node 0: an attempt after a restart ended before its workers were spawned (a stop signal, a
        refusal while it prepared): the record says the restart did not happen, and why."""
        if self.record is None or self.pending is None:
            return
        entry, _ = self.pending
        self.pending = None
        if (signum := stop_signal(error)) is not None:
            why = Halt(self.spec.node_rank, signum).why()
        else:
            why = "no restart: " + (first_line(error) or type(error).__name__)
        if warning := self.record.decide(entry, restarts.Verdict(False, why)):
            self.say(warning)
        self.say("\n".join(self.record.summary()))

    def _stopped_between(self, entry: restarts.Attempt | None, job: AttemptEnd | None) -> None:
        """Node 0: the restart it decided did not happen; the record says so, and lists the attempts."""
        if self.record is None or entry is None or job is None:
            return
        if warning := self.record.end(entry, job, restarts.Verdict(False, "the next round of the rendezvous did not form")):
            self.say(warning)
        self.say("\n".join(self.record.summary()))

    # --- one round ------------------------------------------------------------------------

    def _join(self, spec: NodeSpec, namespace: str) -> Node:
        identity = {"command": self.command} if self.command else cfg.to_dict(self.config)
        node = multinode.join_job(
            spec,
            self.devices.placement,
            identity,
            self.args.join_timeout,
            self.say,
            self.args.node_timeout,
            namespace=namespace,
            hosted=self.hosted,
            restarts=restart_options(self.args.max_restarts, self.args.min_nnodes, self.args.restart_backoff),
        )
        if spec.is_master:
            self.hosted = node.hosted
        if not self.roster:
            self.roster = list(range(spec.nnodes))
        layout = multinode.layout(node, self.devices.placement)
        labels = [layout.label(self.devices.placement.label(local), local) for local in range(layout.nproc)]
        self._post(node, f"devices/{node.rank}", {"devices": labels})
        return node

    @property
    def owned_path(self) -> Path:
        assert self.owned is not None
        return self.owned.path

    def _plan(self, node: Node, number: int) -> tuple[cfg.Config, int, int]:
        """Node 0 chooses the run directory (the first round), the checkpoint and the worker port,
        and shares them; the others take them. The config, the port and the attempt's number."""
        if not node.spec.is_master:
            local_tier.report(node, self.config, self.owned.path if self.owned and self.training else None, self.first_world)
            plan = node.receive("run")
            if self.owned is None:
                if self.args.run_dir and run_dir_path(self.args.run_dir) != Path(plan["run_dir"]):
                    given, used = self.args.run_dir, plan["run_dir"]
                    self.say(f"warning: --run-dir {given} is not node 0's; every node uses node 0's, {used}")
                self.owned = own_run_dir(Path(plan["run_dir"]), lock_name=lock.node_lock_name(self.spec.node_rank))
            training = dataclasses.replace(
                self.config.training, resume=plan["resume"], global_batch_size=plan["global_batch_size"]
            )
            return dataclasses.replace(self.config, training=training), int(plan["worker_port"]), int(plan["attempt"])
        if self.owned is None:
            if self.command:
                self.owned = own_run_dir(run_dir_path(self.args.run_dir))
                config = self.config
            else:
                self.owned, config = resume_point(self.config, self.args.run_dir, self.console, node.world_size)
            self.first_config = config
            self.record = restarts.Record(self.owned.path / restarts.RECORD)
            if self.training:
                warn_without_checkpoints(self.config, self.say)
        else:
            config = self._restart_plan(node).restart_config(node.world_size, self.first_world)
        port = self.free_port()
        node.share(
            "run",
            {
                "run_dir": str(self.owned.path),
                "resume": config.training.resume,
                "global_batch_size": config.training.global_batch_size,
                "worker_port": port,
                "attempt": number,
            },
        )
        return config, port, number

    def _restart_plan(self, node: Node | None = None) -> RestartPlan:
        """The restart plan one machine's attempts follow too (launcher/restart_plan.py): devices again,
        the restart's config (node's: a local checkpoint every node has)."""
        choice = local_tier.choice(node, self.config, self.owned_path, self.first_world, self.say) if node else None
        return RestartPlan(self.args, self.first_config or self.config, self.command, self.owned_path, self.console, choice)

    def _begin(self, config: cfg.Config, begun: list[restarts.Attempt | None]) -> None:
        """Once the attempt's workers are spawned, node 0: its line of restarts.jsonl (every node's
        devices come at its end) into begun, and the restart before it recorded as made."""
        begun.append(self._line(config))

    def _line(self, config: cfg.Config) -> restarts.Attempt | None:
        if self.record is None:
            return None
        resumed = config.training.resume or None if self.training else None
        entry = self.record.begin([], resumed)
        if self.pending is not None:  # the restart before it happened: only now does the record say so
            if warning := self.record.decide(*self.pending):
                self.say(warning)
            self.pending = None
        return entry

    def _post(self, node: Node, key: str, value: dict[str, Any]) -> None:
        try:
            node.post(key, value)
        except Exception:
            pass  # node 0 is gone: the decision below says so

    # --- the decision ---------------------------------------------------------------------

    def _decide(
        self, node: Node, number: int, previous: AttemptEnd | None, entry: restarts.Attempt | None, code: int
    ) -> tuple[Decision, AttemptEnd | None]:
        if not node.spec.is_master:
            return self._follow(node), None
        ends = posted_ends(node, self.args.node_timeout)
        end = job_end(node, ends)
        verdict = restarts.judge(end, number, self.args.max_restarts, previous, self.training)
        wait = restarts.backoff(number + 1, self.args.restart_backoff) if verdict.restart else 0.0
        if entry is not None and self.record is not None:
            entry.devices = [d for n in range(node.spec.nnodes) for d in (node.read(f"devices/{n}") or {}).get("devices", [])]
            # Not "restarted" until the next attempt begins (_begin): a job that ends before then
            # (a stop, a full disk, the round not forming) leaves the line saying so.
            pending = restarts.Verdict(False, f"{verdict.why} (restart {number + 1} pending)")
            if warning := self.record.end(entry, end, pending if verdict.restart else verdict):
                self.say(warning)
            self.pending = (entry, verdict) if verdict.restart else None
        node.post("decision", asdict(Decision(verdict.restart, verdict.why, wait)))
        readers = [n for n in ends if n != 0]
        deadline = time.monotonic() + node.loss_after
        while node.tally("decision_read", 0) < len(readers) and time.monotonic() < deadline:
            time.sleep(POLL_INTERVAL / 2)
        return Decision(verdict.restart, verdict.why, wait), end

    def _follow(self, node: Node) -> Decision:
        """Not node 0: its decision, once node 0 has gathered every node's end."""
        patience = self.args.stop_timeout + self.args.kill_grace + 2 * self.args.node_timeout + 2.0
        deadline = time.monotonic() + patience
        try:
            while (said := node.read("decision")) is None:
                if time.monotonic() >= deadline:
                    return Decision(False, f"node 0 said nothing within {patience:g} s of this node's end")
                time.sleep(POLL_INTERVAL)
            node.tally("decision_read")
        except Exception as error:
            return Decision(False, f"node 0, which hosts the rendezvous, is gone ({first_line(error)}): the job stops")
        return Decision(**said)

    # --- the next round -------------------------------------------------------------------

    def _next_round(self, number: int) -> Node | None:
        """Round `number`: check in, wait for node 0's roster, join. None when the job stops."""
        args, say = self.args, self.say
        if self.spec.is_master:
            roster = gather_round(self.hosted, self.spec, self.roster, number, args.join_timeout, args.min_nnodes, say)
        else:
            roster = check_in(self.spec, number, args.join_timeout, args.node_timeout, say)
        if roster is None:
            return None
        self.roster = roster
        rank = roster.index(self.spec.node_rank)
        spec = dataclasses.replace(self.spec, nnodes=len(roster), node_rank=rank, launched_as=self.spec.node_rank)
        self.say(f"round {number} of the rendezvous: node(s) {', '.join(map(str, roster))} of {self.spec.nnodes}")
        return self._join(spec, f"round{number}")

    def _rejoin(self) -> Node | None:
        """Not node 0, launched while the job runs or restarts (Slurm requeued this node, or it was
        started again by hand): wait for a round of the rendezvous that is open (node 0 opens one
        at each restart) and join it; None while the job's first round forms (join it as usual)."""
        timeout = self.args.join_timeout
        deadline = time.monotonic() + timeout
        raw = connect(self.spec, deadline, timeout, self.args.node_timeout)
        try:
            if not raw.check([ROUND_KEY]) and not raw.check(["joined"]):
                return None
        except Exception as error:
            raise RendezvousError(f"node 0 has ended the job ({first_line(error)}): nothing to join") from None
        with BetweenRounds(self._client, self.spec.node_rank, None):  # between attempts, a stop signal here stops every node
            return self._wait_for_round(raw, deadline)

    def _wait_for_round(self, raw: StoreClient, deadline: float) -> Node:
        timeout, said = self.args.join_timeout, False
        try:
            while (number := open_round(raw)) is None:  # formed without this node: wait for the next
                if time.monotonic() >= deadline:
                    raise RendezvousError(
                        f"the job went on without node {self.spec.node_rank}: no restart opened a round of the rendezvous "
                        f"within {timeout:g} s (--join-timeout); relaunch it at the job's next restart (or, if another "
                        "launcher runs as this node, give each node its own --node-rank)"
                    )
                if not said:
                    self.say(f"the job runs without this node: waiting up to {timeout:g} s (--join-timeout) for its next restart")
                    said = True
                time.sleep(POLL_INTERVAL)
        except RendezvousError:
            raise
        except Exception as error:
            raise RendezvousError(f"node 0 has ended the job ({first_line(error)}): nothing to join") from None
        self.say(f"the job is restarting: joining round {number} of the rendezvous")
        self.between = number  # a stop signal from here on stops the round's nodes too
        node = self._next_round(number)
        if node is None:
            raise RendezvousError(f"round {number} of the rendezvous went on without this node")
        return node
