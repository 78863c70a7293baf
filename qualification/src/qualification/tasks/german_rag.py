"""german-rag-cited (synthetic development track): questions over a generated collection of German
business documents; answers must cite passage ids, or abstain when the collection has no answer.

Scorer: normalised answer correctness, citation precision and recall against the gold passages, and a
penalty for numbers in the answer that no cited passage supports.
"""

from __future__ import annotations

import random
import re
from typing import Any

from .base import Score, TaskItem, ToolParam, ToolSpec, Transcript, hash_bucket, split_rng

ABSTAIN = "keine angabe in den dokumenten"
_ANSWER = re.compile(r"^Antwort:\s*(?P<text>.*?)\s*$")
_CITATION = re.compile(r"\[(D\d{2}-P\d)\]")
_NUMBER = re.compile(r"\d+(?:[.,]\d+)?")

_PRODUCTS = ["Aurora", "Boreas", "Cirrus", "Delta", "Echo", "Fjord", "Granit", "Helix", "Iris", "Jade",
             "Kobalt", "Lotus", "Meridian", "Nova", "Orion", "Polaris"]
_PARTNERS = ["Alpha GmbH", "Berger AG", "Conrad KG", "Dietz & Co", "Ehlers GmbH", "Fink AG", "Gruber KG", "Hansen GmbH"]
_PROJECTS = ["Portal", "Umzug", "Schulung", "Migration", "Messe", "Audit"]


def _collection(seed: int = 0) -> dict[str, Any]:
    """A fixed document collection: 16 product sheets, 8 contracts, 6 meeting notes, 2 policies."""
    rng = random.Random(f"german-rag-cited/collection/{seed}")
    docs: list[dict[str, Any]] = []
    facts: dict[tuple[str, str], tuple[str, str]] = {}  # (entity, attribute) -> (value, passage id)

    def add(title: str, passages: list[tuple[str, dict[tuple[str, str], str]]]) -> None:
        doc_id = f"D{len(docs):02d}"
        entries = []
        for index, (text, doc_facts) in enumerate(passages, start=1):
            pid = f"{doc_id}-P{index}"
            entries.append({"id": pid, "text": text})
            for key, value in doc_facts.items():
                facts[key] = (value, pid)
        docs.append({"id": doc_id, "title": title, "passages": entries})

    for name in _PRODUCTS:
        price, warranty, delivery = rng.randrange(90, 990, 10), rng.choice([12, 24, 36]), rng.randint(2, 14)
        add(f"Produktblatt {name}", [
            (f"Das Modell {name} kostet {price} Euro netto.", {(name, "preis"): f"{price} Euro"}),
            (f"Für {name} gilt eine Garantie von {warranty} Monaten.", {(name, "garantie"): f"{warranty} Monate"}),
            (f"Die Lieferzeit für {name} beträgt {delivery} Werktage.", {(name, "lieferzeit"): f"{delivery} Werktage"}),
        ])
    for partner in _PARTNERS:
        term, notice = rng.choice([12, 24, 36]), rng.choice([1, 3, 6])
        add(f"Rahmenvertrag {partner}", [
            (f"Der Rahmenvertrag mit {partner} hat eine Laufzeit von {term} Monaten.", {(partner, "laufzeit"): f"{term} Monate"}),
            (f"Die Kündigungsfrist gegenüber {partner} beträgt {notice} Monate.", {(partner, "kuendigungsfrist"): f"{notice} Monate"}),
        ])
    for project in _PROJECTS:
        budget = rng.randrange(10, 200) * 1000
        add(f"Protokoll Projekt {project}", [
            (f"Im Projektmeeting wurde das Budget für {project} auf {budget} Euro festgelegt.", {(project, "budget"): f"{budget} Euro"}),
        ])
    add("Reisekostenrichtlinie", [
        (f"Hotelkosten werden bis {rng.randrange(90, 160, 10)} Euro pro Nacht erstattet.", {}),
        (f"Bahnfahrten ab {rng.choice([3, 4, 5])} Stunden dürfen in der ersten Klasse gebucht werden.", {}),
    ])
    return {"docs": docs, "facts": facts}


_COLLECTION = _collection()
_PASSAGES = {p["id"]: p["text"] for doc in _COLLECTION["docs"] for p in doc["passages"]}
_QUESTIONS = {
    "preis": ("Wie hoch ist der Preis von {e}?", "Preis {e}"),
    "garantie": ("Wie lange gilt die Garantie für {e}?", "Garantie {e}"),
    "lieferzeit": ("Wie lang ist die Lieferzeit für {e}?", "Lieferzeit {e}"),
    "laufzeit": ("Welche Laufzeit hat der Rahmenvertrag mit {e}?", "Laufzeit {e}"),
    "kuendigungsfrist": ("Welche Kündigungsfrist gilt gegenüber {e}?", "Kündigungsfrist {e}"),
    "budget": ("Wie hoch ist das Budget für das Projekt {e}?", "Budget {e}"),
}
_STOPWORDS = {"wie", "hoch", "ist", "der", "die", "das", "den", "von", "für", "gilt", "welche", "hat", "mit", "lang",
              "lange", "und", "zusammen", "kosten", "viel", "modell", "modelle", "gegenüber", "projekt", "beträgt"}


def normalise(text: str) -> str:
    """Lower case, '€' as 'euro', thousands separators dropped, punctuation as spaces, single spaces."""
    text = re.sub(r"(\d)[.](\d{3})", r"\1\2", text.lower().replace("€", " euro"))
    return " ".join(re.sub(r"[^\w ]+", " ", text).split())


def _words(text: str) -> set[str]:
    return {w for w in re.findall(r"\w+", text.lower()) if len(w) > 2 and w not in _STOPWORDS}


def search(query: str, k: int = 3) -> list[tuple[str, str]]:
    """Keyword overlap ranking (ties by passage id): the collection's search tool."""
    wanted = _words(query)
    ranked = sorted(_PASSAGES.items(), key=lambda kv: (-len(wanted & _words(kv[1])), kv[0]))
    return [(pid, text) for pid, text in ranked[:k] if wanted & _words(text)]


def parse_answer(final_text: str) -> tuple[str | None, list[str]]:
    """(answer text without citations, cited passage ids) from the last 'Antwort:' line."""
    for line in reversed([line.strip() for line in final_text.strip().splitlines() if line.strip()]):
        match = _ANSWER.match(line)
        if match:
            cited = _CITATION.findall(match.group("text"))
            return _CITATION.sub("", match.group("text")).strip(), list(dict.fromkeys(cited))
    return None, []


class GermanRagCited:
    name = "german-rag-cited"
    scorer_version = 1
    synthetic = True
    frozen_splits = {"train": (64, 1), "heldout": (48, 2)}  # split: (n, seed) as the shipped plans use them
    system_prompt = ("Beantworte die Frage mit den Dokumenten. Nutze die Suche. Antworte mit "
                     "'Antwort: <Antwort> [Passage-ID]' oder 'Antwort: Keine Angabe in den Dokumenten.'")
    tools = (
        ToolSpec(name="suche", description="Durchsucht die Firmendokumente und liefert passende Passagen mit ID.",
                 params=(ToolParam("anfrage", "string", "Suchbegriffe, z. B. 'Preis Aurora'."),)),
    )

    def generate(self, split: str, n: int, seed: int) -> list[TaskItem]:
        rng = split_rng(self.name, split, seed)
        facts = sorted(_COLLECTION["facts"].items())
        items: list[TaskItem] = []
        seen: set[str] = set()
        while len(items) < n:
            kind = rng.choices(["single", "sum", "abstain"], weights=[5, 3, 2])[0]
            if kind == "single":
                (entity, attribute), (value, pid) = rng.choice(facts)
                question = _QUESTIONS[attribute][0].format(e=entity)
                reference = {"kind": kind, "answer": value, "passages": [pid],
                             "queries": [_QUESTIONS[attribute][1].format(e=entity)]}
            elif kind == "sum":
                models = rng.sample(_PRODUCTS, rng.choice([2, 2, 3]))  # two or three passages
                found = [_COLLECTION["facts"][(m, "preis")] for m in models]
                total = sum(int(price.split()[0]) for price, _ in found)
                names = " und ".join([", ".join(models[:-1]), models[-1]])
                question = f"Wie viel kosten die Modelle {names} zusammen?"
                reference = {"kind": kind, "answer": f"{total} Euro", "passages": [pid for _, pid in found],
                             "queries": [f"Preis {m}" for m in models]}
            else:
                missing = f"{rng.choice(['Zenit', 'Quarz', 'Vektor', 'Wolke'])}-{rng.randint(100, 999)}"
                question = f"Wie lange gilt die Garantie für das Modell {missing}?"
                reference = {"kind": kind, "answer": None, "passages": [], "queries": [f"Garantie {missing}"]}
            # Held-out questions come from a disjoint slice of the question space. Evaluation splits count
            # each question once; training data may repeat a question (the single-fact space is small).
            if (hash_bucket(question) == 0) != (split == "heldout") or (split != "train" and question in seen):
                continue
            seen.add(question)
            items.append(TaskItem(family=self.name, split=split, task_id=f"{self.name}/{split}/{seed}/{len(items)}",
                                  question=question, reference=reference))
        return items

    def initial_state(self, item: TaskItem) -> dict[str, Any]:
        return {}

    def call_tool(self, item: TaskItem, state: dict[str, Any], name: str, arguments: dict[str, Any]) -> str:
        if name != "suche":
            return f"Fehler: unbekanntes Werkzeug {name!r}"
        hits = search(str(arguments.get("anfrage", "")))
        return "\n".join(f"[{pid}] {text}" for pid, text in hits) or "Keine Treffer."

    def score(self, item: TaskItem, transcript: Transcript) -> Score:
        answer, cited = parse_answer(transcript.final_text)
        gold = set(item.reference["passages"])
        abstained = answer is not None and normalise(answer).startswith(ABSTAIN)
        if item.reference["kind"] == "abstain":
            correct = abstained
        else:
            correct = answer is not None and not abstained and normalise(item.reference["answer"]) in normalise(answer)
        unknown = [pid for pid in cited if pid not in _PASSAGES]
        precision = len(gold & set(cited)) / len(cited) if cited else float(not gold)
        recall = len(gold & set(cited)) / len(gold) if gold else float(not cited)
        supported_numbers = set(_NUMBER.findall(" ".join(_PASSAGES.get(pid, "") for pid in cited)))
        derived = set(_NUMBER.findall(item.reference["answer"] or "")) if item.reference["kind"] == "sum" else set()
        claims = set(_NUMBER.findall(answer or "")) - supported_numbers - derived
        penalty = 0.25 if claims or unknown else 0.0
        reward = max(0.0, 0.5 * correct + 0.25 * precision + 0.25 * recall - penalty) if answer is not None else 0.0
        success = bool(correct and precision == 1.0 and recall == 1.0 and not claims and not unknown)
        components = {"well_formed": float(answer is not None), "correct": float(correct),
                      "citation_precision": precision, "citation_recall": recall,
                      "unsupported_claims": float(len(claims) + len(unknown)), "abstained": float(abstained)}
        return Score(reward=round(reward, 6), success=success, components=components,
                     outcome="success" if success else "failure")

    def demonstration(self, item: TaskItem) -> list[dict[str, Any]]:
        """One search per fact needed, then the cited answer (or the abstention)."""
        messages: list[dict[str, Any]] = []
        for query in item.reference["queries"]:
            messages.append({"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "suche", "arguments": {"anfrage": query}}}]})
            messages.append({"role": "tool", "name": "suche", "content": self.call_tool(item, {}, "suche", {"anfrage": query})})
        if item.reference["kind"] == "abstain":
            final = "Antwort: Keine Angabe in den Dokumenten."
        else:
            final = f"Antwort: {item.reference['answer']} " + " ".join(f"[{p}]" for p in item.reference["passages"])
        return messages + [{"role": "assistant", "content": final}]

    def scripted_cases(self, item: TaskItem) -> list[dict[str, Any]]:
        reference = item.reference
        call = {"tool_call": {"name": "suche", "arguments": {"anfrage": reference["queries"][0]}}}
        cite = " ".join(f"[{p}]" for p in reference["passages"])
        if reference["kind"] == "abstain":
            return [
                {"case": "abstains", "expected_success": True,
                 "turns": [call, {"text": "Antwort: Keine Angabe in den Dokumenten."}]},
                {"case": "hallucinates", "expected_success": False, "turns": [call, {"text": "Antwort: 24 Monate [D00-P2]"}]},
            ]
        return [
            {"case": "correct-cited", "expected_success": True, "turns": [call, {"text": f"Antwort: {reference['answer']} {cite}"}]},
            {"case": "right-answer-wrong-citation", "expected_success": False,
             "turns": [call, {"text": f"Antwort: {reference['answer']} [D31-P1]"}]},
            {"case": "uncited", "expected_success": False, "turns": [call, {"text": f"Antwort: {reference['answer']}"}]},
            {"case": "wrong-abstention", "expected_success": False,
             "turns": [call, {"text": "Antwort: Keine Angabe in den Dokumenten."}]},
            {"case": "malformed", "expected_success": False, "turns": [{"text": reference["answer"]}]},
        ]

