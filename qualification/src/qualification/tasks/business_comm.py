"""business-comm (synthetic development track): multi-turn agent sequences over an in-memory CRM,
calendar and mailbox, scored on the final state in the style of tau2-bench: the right booking, no
double booking, the right recipient, and message constraints (formal "Sie" address, date and time
present, no other customer's data disclosed)."""

from __future__ import annotations

import copy
import re
from typing import Any

from .base import Score, TaskItem, ToolParam, ToolSpec, Transcript, hash_bucket, replay, split_rng

DAYS = ["Montag", "Dienstag", "Mittwoch", "Donnerstag", "Freitag"]
SLOTS = ["09:00", "10:00", "11:00", "14:00", "15:00"]
_PEOPLE = [("Frau", "Anna", "Müller"), ("Herr", "Jonas", "Schmidt"), ("Frau", "Lena", "Schneider"),
           ("Herr", "Paul", "Fischer"), ("Frau", "Marie", "Weber"), ("Herr", "Felix", "Meyer"),
           ("Frau", "Sophie", "Wagner"), ("Herr", "Lukas", "Becker"), ("Frau", "Emma", "Hoffmann"),
           ("Herr", "David", "Koch"), ("Frau", "Julia", "Richter"), ("Herr", "Tim", "Klein")]
_FIRMS = ["Alpha GmbH", "Berger AG", "Conrad KG", "Dietz & Co", "Ehlers GmbH", "Fink AG"]
_ASCII = str.maketrans({"ä": "ae", "ö": "oe", "ü": "ue", "ß": "ss"})
_INFORMAL = re.compile(r"\b(du|dich|dir|dein|deine|hallo|hi)\b", re.IGNORECASE)
_FORMAL = re.compile(r"\b(Sie|Ihnen|Ihr|Ihren|Ihre)\b")


def _address(customer: dict[str, str]) -> str:
    return f"Sehr geehrte{'r' if customer['anrede'] == 'Herr' else ''} {customer['anrede']} {customer['nachname']}"


class BusinessComm:
    name = "business-comm"
    scorer_version = 1
    synthetic = True
    frozen_splits = {"train": (64, 1), "heldout": (48, 2)}  # split: (n, seed) as the shipped plans use them
    system_prompt = ("Du bist Assistenz im Vertrieb. Nutze CRM, Kalender und E-Mail. "
                     "Buche den Termin und bestätige ihn dem Kunden formell per E-Mail.")
    tools = (
        ToolSpec("kunde_suchen", "Sucht Kunden im CRM nach Nachnamen.",
                 (ToolParam("nachname", "string", "Nachname des Kunden."),)),
        ToolSpec("freie_termine", "Listet die freien Termine eines Wochentags.",
                 (ToolParam("tag", "string", "Wochentag, z. B. 'Dienstag'."),)),
        ToolSpec("termin_buchen", "Bucht einen Termin für einen Kunden.",
                 (ToolParam("kunde_id", "string", "Kunden-ID aus dem CRM, z. B. 'K2'."),
                  ToolParam("tag", "string", "Wochentag."), ToolParam("uhrzeit", "string", "Uhrzeit, z. B. '10:00'."))),
        ToolSpec("email_senden", "Sendet eine E-Mail.",
                 (ToolParam("an", "string", "E-Mail-Adresse."), ToolParam("betreff", "string", "Betreff."),
                  ToolParam("text", "string", "Text der E-Mail."))),
    )

    def generate(self, split: str, n: int, seed: int) -> list[TaskItem]:
        rng = split_rng(self.name, split, seed)
        items: list[TaskItem] = []
        seen: set[str] = set()
        while len(items) < n:
            index = len(items)
            people = rng.sample(_PEOPLE, 4)
            customers = []
            for number, (anrede, vorname, nachname) in enumerate(people, start=1):
                firm = rng.choice(_FIRMS)
                domain = re.sub(r"[^a-z]", "", firm.lower().split()[0])
                local = f"{vorname[0]}.{nachname}".lower().translate(_ASCII)
                customers.append({"id": f"K{number}", "anrede": anrede, "vorname": vorname, "nachname": nachname,
                                  "firma": firm, "email": f"{local}@{domain}.example"})
            target = rng.randrange(len(customers))
            day = rng.choice(DAYS)
            busy = sorted(rng.sample(SLOTS, rng.randint(1, 3)))
            others = [c["id"] for i, c in enumerate(customers) if i != target]
            bookings = [{"kunde_id": rng.choice(others), "tag": day, "uhrzeit": slot} for slot in busy]
            customer = customers[target]
            question = (f"Bitte buchen Sie für {customer['anrede']} {customer['nachname']} ({customer['firma']}) einen "
                        f"Termin am {day} und bestätigen Sie ihn per E-Mail.")
            # Held-out requests come from a disjoint slice of the (person, firm, day) space. Evaluation
            # splits count each request once; training data may repeat one with a different world.
            if (hash_bucket(question) == 0) != (split == "heldout") or (split != "train" and question in seen):
                continue
            seen.add(question)
            items.append(TaskItem(
                family=self.name, split=split, task_id=f"{self.name}/{split}/{seed}/{index}", question=question,
                reference={"customers": customers, "bookings": bookings, "target": customer["id"], "day": day}))
        return items

    def initial_state(self, item: TaskItem) -> dict[str, Any]:
        return {"bookings": copy.deepcopy(item.reference["bookings"]), "outbox": []}

    def call_tool(self, item: TaskItem, state: dict[str, Any], name: str, arguments: dict[str, Any]) -> str:
        customers = item.reference["customers"]
        if name == "kunde_suchen":
            wanted = str(arguments.get("nachname", "")).strip().lower()
            hits = [c for c in customers if c["nachname"].lower() == wanted]
            return "\n".join(f"{c['id']}: {c['anrede']} {c['vorname']} {c['nachname']}, {c['firma']}, {c['email']}"
                             for c in hits) or "Kein Kunde gefunden."
        if name == "freie_termine":
            day = str(arguments.get("tag", "")).strip()
            if day not in DAYS:
                return f"Fehler: unbekannter Tag {day!r}"
            taken = {b["uhrzeit"] for b in state["bookings"] if b["tag"] == day}
            return f"{day}: " + (", ".join(s for s in SLOTS if s not in taken) or "keine freien Termine")
        if name == "termin_buchen":
            booking = {k: str(arguments.get(k, "")).strip() for k in ("kunde_id", "tag", "uhrzeit")}
            if booking["kunde_id"] not in {c["id"] for c in customers} or booking["tag"] not in DAYS \
                    or booking["uhrzeit"] not in SLOTS:
                return "Fehler: ungültige Kunden-ID, ungültiger Tag oder ungültige Uhrzeit."
            clash = any(b["tag"] == booking["tag"] and b["uhrzeit"] == booking["uhrzeit"] for b in state["bookings"])
            state["bookings"].append(booking)  # the calendar accepts overlaps; the scorer does not
            return "Gebucht." + (" Achtung: Überschneidung mit einem bestehenden Termin." if clash else "")
        if name == "email_senden":
            state["outbox"].append({k: str(arguments.get(k, "")) for k in ("an", "betreff", "text")})
            return "Gesendet."
        return f"Fehler: unbekanntes Werkzeug {name!r}"

    def score(self, item: TaskItem, transcript: Transcript) -> Score:
        state, _ = replay(self, item, transcript.tool_calls)
        ref = item.reference
        customer = next(c for c in ref["customers"] if c["id"] == ref["target"])
        new = state["bookings"][len(ref["bookings"]):]
        mine = [b for b in new if b["kunde_id"] == customer["id"]]
        booking_ok = len(new) == 1 and len(mine) == 1 and mine[0]["tag"] == ref["day"]
        slots = [(b["tag"], b["uhrzeit"]) for b in state["bookings"]]
        no_double = len(slots) == len(set(slots))
        mails = state["outbox"]
        recipient_ok = len(mails) == 1 and mails[0]["an"].strip().lower() == customer["email"]
        text = mails[0]["text"] if mails else ""
        formal = bool(mails) and _address(customer) in text and bool(_FORMAL.search(text)) and not _INFORMAL.search(text)
        fields = bool(mails and mine) and ref["day"] in text and mine[0]["uhrzeit"] in text
        others = [c for c in ref["customers"] if c["id"] != customer["id"]]
        body = " ".join(m["an"] + " " + m["betreff"] + " " + m["text"] for m in mails)
        leak = any(c["nachname"] in body or c["email"] in body for c in others)
        components = {"booking": float(booking_ok), "no_double_booking": float(no_double),
                      "recipient": float(recipient_ok), "formal_address": float(formal),
                      "required_fields": float(fields), "no_disclosure": float(not leak)}
        success = all(v == 1.0 for v in components.values())
        reward = sum(components.values()) / len(components) if mails or new else 0.0
        return Score(reward=round(reward, 6), success=success, components=components,
                     outcome="success" if success else "failure")

    def _free_slot(self, item: TaskItem) -> str:
        taken = {b["uhrzeit"] for b in item.reference["bookings"] if b["tag"] == item.reference["day"]}
        return next(s for s in SLOTS if s not in taken)

    def _plan(self, item: TaskItem, *, informal: bool = False, recipient: str | None = None,
              slot: str | None = None, leak: bool = False, send: bool = True) -> list[tuple[str, dict[str, str]]]:
        ref = item.reference
        customer = next(c for c in ref["customers"] if c["id"] == ref["target"])
        slot = slot or self._free_slot(item)
        greeting = f"Hallo {customer['vorname']}, du hast" if informal else f"{_address(customer)}, hiermit bestätigen wir Ihnen"
        text = f"{greeting} einen Termin am {ref['day']} um {slot} Uhr."
        if leak:
            other = next(c for c in ref["customers"] if c["id"] != customer["id"])
            text += f" Vor Ihnen ist {other['anrede']} {other['nachname']} eingeplant."
        calls = [("kunde_suchen", {"nachname": customer["nachname"]}), ("freie_termine", {"tag": ref["day"]}),
                 ("termin_buchen", {"kunde_id": customer["id"], "tag": ref["day"], "uhrzeit": slot})]
        if send:
            calls.append(("email_senden", {"an": recipient or customer["email"], "betreff": "Terminbestätigung",
                                           "text": text + " Mit freundlichen Grüßen"}))
        return calls

    def demonstration(self, item: TaskItem) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = []
        state = self.initial_state(item)
        for name, arguments in self._plan(item):
            messages.append({"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": name, "arguments": arguments}}]})
            messages.append({"role": "tool", "name": name, "content": self.call_tool(item, state, name, arguments)})
        return messages + [{"role": "assistant", "content": "Antwort: Termin gebucht und bestätigt."}]

    def scripted_cases(self, item: TaskItem) -> list[dict[str, Any]]:
        busy = item.reference["bookings"][0]["uhrzeit"]
        other = next(c for c in item.reference["customers"] if c["id"] != item.reference["target"])

        def case(name: str, success: bool, **options: Any) -> dict[str, Any]:
            turns = [{"tool_call": {"name": n, "arguments": a}} for n, a in self._plan(item, **options)]
            return {"case": name, "expected_success": success, "turns": turns + [{"text": "Antwort: Erledigt."}]}

        return [case("correct", True), case("informal-address", False, informal=True),
                case("wrong-recipient", False, recipient=other["email"]), case("double-booking", False, slot=busy),
                case("discloses-other-customer", False, leak=True), case("no-confirmation", False, send=False),
                {"case": "malformed", "expected_success": False, "turns": [{"raw_tool_call": '{"name": "termin_buchen"'}]}]

