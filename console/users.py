"""Users and their roles, managed inside the console (admins only): list, add, change the role, deactivate.

A role is one of the four groups (ramdeck_site/roles.py). Every change is audited. An admin cannot take
away their own admin role or deactivate themselves, and the last active admin stays one: the console is
never left without someone who can manage it. A superuser (made by `manage.py ensure_admin` or
`createsuperuser`) is an admin whatever its groups say, so its role is not offered for change here.
"""

from __future__ import annotations

from django import forms
from django.contrib import messages
from django.contrib.auth import get_user_model
from django.contrib.auth.forms import UserCreationForm
from django.contrib.auth.models import Group
from django.db import transaction
from django.db.models import Q
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_POST

from audit import history
from ramdeck_site import lockout
from ramdeck_site.roles import ADMIN, CHAT, OPERATOR, ROLES, VIEWER, highest_role, role_of, role_required

User = get_user_model()
ROLE_CHOICES = [
    (VIEWER, "Viewer: sees everything, changes nothing"),
    (CHAT, "Chat: a viewer who may also chat with running models and see their endpoint and key"),
    (OPERATOR, "Operator: probes, builds, plans, deploys and stops"),
    (ADMIN, "Admin: also nodes, credentials, host keys, users"),
]


def set_role(user, role: str) -> None:
    """Make `role` the user's only role group."""
    user.groups.remove(*Group.objects.filter(name__in=ROLES))
    user.groups.add(Group.objects.get_or_create(name=role)[0])
    user.__dict__.pop("_ramdeck_role", None)


def _active_admins():
    return User.objects.filter(is_active=True).filter(Q(is_superuser=True) | Q(groups__name=ADMIN))


def active_admin_count() -> int:
    return _active_admins().distinct().count()


def lock_admins() -> None:
    """Inside a transaction: wait for any other transaction that may be taking an admin away, and keep the
    next one waiting until this one ends. Two admins demoting each other at the same moment would otherwise
    both count two admins, and both succeed.

    PostgreSQL: the active admins' rows are locked (in primary-key order, so two of these never deadlock);
    the count that follows is a new statement, which sees what a transaction it waited for committed.
    SQLite: select_for_update does nothing, but the console's transactions begin IMMEDIATE (settings.py),
    which takes the database's write lock at once, so they run one after another anyway.
    """
    admins = User.objects.filter(pk__in=_active_admins().values("pk")).order_by("pk")
    list(admins.select_for_update().values_list("pk", flat=True))


class UserCreateForm(UserCreationForm):
    role = forms.ChoiceField(choices=ROLE_CHOICES, initial=VIEWER, widget=forms.RadioSelect)

    class Meta(UserCreationForm.Meta):
        model = User
        fields = ("username", "email")


class UserEditForm(forms.Form):
    role = forms.ChoiceField(choices=ROLE_CHOICES, widget=forms.RadioSelect)
    is_active = forms.BooleanField(
        label="Active", required=False, help_text="A deactivated user cannot log in; their history stays."
    )

    def __init__(self, *args, target, by, **kwargs):
        super().__init__(*args, **kwargs)
        self.target, self.by = target, by
        if target.is_superuser:
            self.fields["role"].disabled = True
            self.fields["role"].help_text = "A superuser is always an admin."

    def clean(self):
        cleaned = super().clean()
        role = ADMIN if self.target.is_superuser else cleaned.get("role")
        active = cleaned.get("is_active")
        if self.target.pk == self.by.pk and not (role == ADMIN and active):
            raise forms.ValidationError(
                "You cannot take away your own admin role or deactivate yourself; ask another admin."
            )
        cleaned["role"] = role
        return cleaned

    def last_admin_problem(self) -> str | None:
        """Why this change may not be saved because it would leave no active admin, or None. Asked inside
        the saving transaction after `lock_admins()`, never before it: a count taken earlier may be stale by
        the time the change is written."""
        stays_admin = self.cleaned_data["role"] == ADMIN and self.cleaned_data["is_active"]
        self.target.refresh_from_db(fields=["is_active", "is_superuser"])
        self.target.__dict__.pop("_ramdeck_role", None)
        was_admin = role_of(self.target) == ADMIN
        if was_admin and not stays_admin and active_admin_count() <= 1:
            return f"{self.target.get_username()} is the last active admin."
        return None


@role_required(ADMIN)
def user_list(request):
    users = User.objects.order_by("username").prefetch_related("groups")
    locked = lockout.locked_usernames()
    rows = [
        {
            "user": user,
            "role": role_of(user) if user.is_active else _stored_role(user),
            "locked": user.get_username() in locked,
        }
        for user in users
    ]
    return render(request, "console/users/user_list.html", {"rows": rows})


@require_POST
@role_required(ADMIN)
def user_unlock(request, pk: int):
    """End an account's login lockout at once (ramdeck_site/lockout.py): its failed logins are forgotten.
    The way back for a user someone locked out by guessing; audited. For the last admin, locked out with
    nobody to press this, `manage.py axes_reset_username NAME` on the console's host does the same."""
    target = get_object_or_404(User, pk=pk)
    name = target.get_username()
    forgotten = lockout.unlock(name)
    if forgotten:
        history.record(request, "user.unlock", target, changes={"failure_records": forgotten})
        messages.success(request, f"{name} may log in again: their failed logins are forgotten.")
    else:
        messages.info(request, f"{name} was not locked out.")
    return redirect("users:list")


def _stored_role(user) -> str | None:
    """The role a deactivated user would have again (role_of says None for them)."""
    if user.is_superuser:
        return ADMIN
    names = {group.name for group in user.groups.all()}
    return highest_role(names)


@role_required(ADMIN)
def user_create(request):
    form = UserCreateForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        with transaction.atomic():
            user = form.save()
            set_role(user, form.cleaned_data["role"])
            changes = {"username": user.get_username(), "role": form.cleaned_data["role"]}
            if user.email:
                changes["email"] = user.email
            history.record(request, "user.create", user, changes=changes)
        messages.success(request, f"User {user.get_username()} added as {form.cleaned_data['role']}.")
        return redirect("users:list")
    status = 400 if form.errors else 200
    return render(request, "console/users/user_form.html", {"form": form, "target": None}, status=status)


@role_required(ADMIN)
def user_edit(request, pk: int):
    target = get_object_or_404(User, pk=pk)
    old_role, old_active = _stored_role(target), target.is_active
    initial = {"role": old_role or VIEWER, "is_active": target.is_active}
    form = UserEditForm(request.POST or None, initial=initial, target=target, by=request.user)
    if request.method == "POST" and form.is_valid():
        role, active = form.cleaned_data["role"], form.cleaned_data["is_active"]
        changes = {}
        with transaction.atomic():
            lock_admins()
            problem = form.last_admin_problem()
            if problem is None:
                old_role, old_active = _stored_role(target), target.is_active  # as they are now, locked
                if role != old_role and not target.is_superuser:
                    set_role(target, role)
                    changes["role"] = [old_role, role]
                if active != old_active:
                    target.is_active = active
                    target.save(update_fields=["is_active"])
                    changes["active"] = [old_active, active]
                if changes:
                    history.record(request, "user.update", target, changes=changes)
        if problem is None:
            if changes:
                messages.success(request, f"User {target.get_username()} saved.")
            else:
                messages.info(request, "Nothing changed.")
            return redirect("users:list")
        form.add_error(None, problem)
    status = 400 if form.errors else 200
    context = {"form": form, "target": target}
    return render(request, "console/users/user_form.html", context, status=status)
