from qualification.tasks import ToolCall, Transcript, exact_overlap, get_family, split_hash, strict_final_answer


def test_generators_are_deterministic_and_hashed():
    family = get_family("calc-tool")
    a, b = family.generate("train", 20, 1), family.generate("train", 20, 1)
    assert a == b and split_hash(a) == split_hash(b)
    assert split_hash(family.generate("train", 20, 2)) != split_hash(a)


def test_train_and_heldout_are_disjoint():
    family = get_family("calc-tool")
    train, heldout = family.generate("train", 500, 1), family.generate("heldout", 200, 1)
    assert exact_overlap(train, heldout) == 0
    assert not {i.reference["expression"] for i in train} & {i.reference["expression"] for i in heldout}


def test_strict_final_answer():
    assert strict_final_answer("Rechnung...\nAntwort: 42") == 42
    assert strict_final_answer("Antwort: -3 ") == -3
    assert strict_final_answer("Antwort: 42 Euro") is None
    assert strict_final_answer("Die Antwort ist 42") is None
    assert strict_final_answer("") is None


def _calc_case(final: str, calls: list[tuple[str, str]]):
    family = get_family("calc-tool")
    item = family.generate("heldout", 1, 5)[0]
    transcript = Transcript(final_text=final.format(**item.reference),
                            tool_calls=[ToolCall("rechner", {"ausdruck": e.format(**item.reference)},
                                                 family.call_tool(item, "rechner", {"ausdruck": e.format(**item.reference)}))
                                        for _, e in calls])
    return family.score(item, transcript)


def test_calc_tool_scorer_known_answers():
    right = _calc_case("Antwort: {answer}", [("rechner", "{expression}")])
    assert right.success and right.reward == 1.0
    wrong = _calc_case("Antwort: 1", [("rechner", "{expression}")])
    assert not wrong.success and wrong.components["tool_called"] == 1.0
    lucky = _calc_case("Antwort: {answer}", [])
    assert not lucky.success and lucky.components["correct"] == 1.0, "a right answer without the tool is not grounded"
    malformed = _calc_case("{expression} ist das Ergebnis", [("rechner", "{expression}")])
    assert not malformed.success and malformed.components["well_formed"] == 0.0


def test_calculator_tool_rejects_other_input():
    family = get_family("calc-tool")
    item = family.generate("train", 1, 0)[0]
    assert family.call_tool(item, "rechner", {"ausdruck": "12 * 3"}) == "36"
    assert family.call_tool(item, "rechner", {"ausdruck": "__import__('os')"}).startswith("Fehler")
    assert family.call_tool(item, "shell", {}).startswith("Fehler")


def test_scripted_cases_match_the_reference_scorer():
    for name in ("calc-tool", "german-arith"):
        family = get_family(name)
        item = family.generate("train", 1, 3)[0]
        cases = family.scripted_cases(item)
        assert any(c["expected_success"] for c in cases) and not all(c["expected_success"] for c in cases)
